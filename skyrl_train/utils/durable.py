"""Writing files so that a crash leaves either the old bytes or the new, never half.

Shared by checkpoints (``runs/checkpoint.py``) and the metrics log
(``utils/tracking.py``): a file's bytes are fsynced before anything vouches for them,
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


def replace_file(path: Path, data: bytes) -> None:
    """Replace ``path``'s contents atomically: written beside it, fsynced, renamed over."""
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    write_file(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
