"""A folder's contents as data, for tests that a refused operation changed nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's SHA-256, or "dir"."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(folder.rglob("*"))
    }
