"""List the project's modules over the size a reader takes in one sitting whose
docstring does not say why they are kept whole; exit 1 if there are any.

A module over ``LIMIT`` lines passes when its docstring has a paragraph starting with
``MARKER``: the reason it is one module (one table, one algorithm read top to bottom,
one command's script), so a growing file is either split or argued for.
Run by ``scripts/test.sh``; ``--list`` prints every module over the limit with its
state.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

LIMIT = 400
MARKER = "Kept whole:"
ROOTS = ("inference", "skyrl_train", "skyrl_gym", "scripts")


def oversized(root: Path) -> list[tuple[Path, int, bool]]:
    """``(module, lines, argued)`` for every module over ``LIMIT`` lines under ``ROOTS``."""
    found = []
    for package in ROOTS:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            lines = text.count("\n")
            if lines <= LIMIT:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            argued = any(part.lstrip().startswith(MARKER) for part in doc.split("\n\n"))
            found.append((path.relative_to(root), lines, argued))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every oversized module")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    found = oversized(args.root)
    bad = [(path, lines) for path, lines, argued in found if not argued]
    if args.list:
        for path, lines, argued in found:
            print(f"{lines:5d}  {path}  {'argued' if argued else 'NOT ARGUED'}")
    for path, lines in bad:
        print(
            f"{path}: expected at most {LIMIT} lines or a docstring paragraph starting "
            f"{MARKER!r}, got {lines} lines and none",
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
