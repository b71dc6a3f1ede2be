"""Writing files so that a crash leaves either the old bytes or the new, never half.

Shared by checkpoints (``runs/checkpoint.py``), Hugging Face exports
(``runs/export.py``) and the metrics log (``utils/tracking.py``): a file's bytes are fsynced before anything vouches for them,
and a rename is durable only once the folder holding the new entry is synced.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_file(path: Path, data: bytes | Callable[[BinaryIO], object]) -> None:
    """Create ``path`` with ``data`` (bytes, or a writer such as ``torch.save``'s) and
    fsync it, so its bytes are on disk before a manifest or a rename vouches for them."""
    with path.open("xb") as fh:  # "x": two writers of one name is a bug, not a retry
        if isinstance(data, bytes):
            fh.write(data)
        else:
            data(fh)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(folder: Path) -> None:
    """Make the renames and creations inside ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: Path) -> Path:
    """Where ``path`` is written before a rename makes it ``path``: its name plus
    ``.tmp-`` and 8 hex digits, beside it (a rename is atomic within one folder)."""
    return path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")


def rename_into_place(folder: Path, final: Path, *, aside: Path | None) -> None:
    """Rename the finished ``folder`` to ``final``, durably; whatever is at ``final`` is
    first renamed to ``aside`` (the caller removes or keeps it), so a crash between the
    two renames leaves no ``final``, never a mix of old and new."""
    if aside is not None:
        os.rename(final, aside)
    os.rename(folder, final)
    fsync_dir(final.parent)


def replace_file(path: Path, data: bytes) -> None:
    """Replace ``path``'s contents atomically: written beside it, fsynced, renamed over."""
    tmp = temp_sibling(path)
    write_file(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
