"""scripts/check_module_size.py: a module over the limit passes only with its reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_module_size.py"


def _module(lines: int, doc: str) -> str:
    return f'"""{doc}"""\n' + "x = 1\n" * (lines - 1)


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_an_unargued_long_module_fails_naming_it(tmp_path: Path) -> None:
    package = tmp_path / "skyrl_train"
    package.mkdir()
    (package / "short.py").write_text(_module(400, "Small."))
    (package / "argued.py").write_text(_module(450, "Big.\n\nKept whole: one table.\n"))
    (package / "long.py").write_text(_module(401, "Big, and says nothing about it."))
    result = _check(tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "skyrl_train/long.py: expected at most 400 lines or a docstring paragraph "
        "starting 'Kept whole:', got 401 lines and none"
    ]
    (package / "long.py").write_text(_module(401, "Big.\n\nKept whole: one algorithm.\n"))
    assert _check(tmp_path).returncode == 0


def test_the_project_passes() -> None:
    result = _check(ROOT)
    assert result.returncode == 0, result.stderr
