"""Which launch writes a run folder: a lock held for the launch's life, taken before any
work, and the acceptance that makes the folder this run's (docs/configuration.md, Run
folders).

``hold_run_dir`` is a training launch's first step after ``validate_cfg``: it creates
``run_dir`` and takes an exclusive ``flock`` on ``<run_dir>/run.lock``, which records
the holder (pid, host, start time). A second launch into the folder while the first
runs is refused at once, naming the first; one that comes after it ends finds the first
run's artefacts and is refused by ``check_run_dir``, which runs again under the lock,
so no launch acts on a check another launch could invalidate. The kernel drops the
lock when the process dies, however it dies, so a crash never leaves a folder locked.

Everything else comes under the lock: the datasets, ``trainer.resume_from``'s hashes
(``latest`` resolved), then ``RunDirClaim.accept``, which writes ``run.json`` at the
run's first launch and, for a launch resuming below later checkpoints (allowed only
with ``trainer.overwrite_later_checkpoints``: a branch), deletes at once what the branch
supersedes: those checkpoints, this run's exports of later steps, the later lines
of ``metrics.jsonl`` and the later rollout dumps. From that moment ``latest`` can only name the branch point or the
branch's own saves, so a branch preempted before its first save resumes where it
branched, and the folder holds one history.

A launch refused before ``accept`` leaves nothing behind: the lock file goes, and so do
the folders it created. The lock file is removed on every release while still locked,
and a launch that locks a file no longer at the path retries, so two launches can never
both hold one folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.checkpoint import list_checkpoints, verify_checkpoint
from skyrl_train.runs.export import export_root, list_exports, read_marker
from skyrl_train.runs.folder import (
    CHECKPOINTS_DIR,
    MARKER_FILE,
    MARKER_FORMAT,
    check_later_checkpoints,
    check_run_dir,
    check_run_dir_path,
)
from skyrl_train.utils.durable import fsync_dir, temp_sibling, write_file
from skyrl_train.runs.rollouts import drop_dumps_after
from skyrl_train.utils.tracking import drop_steps_after

if TYPE_CHECKING:
    from skyrl_train.config.schema import PPOConfig

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
METRICS_FILE = "metrics.jsonl"
"""``utils.tracking.JsonlTracker``'s file."""
_KEY = "trainer.run_dir"


@dataclass(frozen=True)
class Holder:
    """The launch holding a folder, as its ``run.lock`` records it."""

    pid: int
    host: str
    started_at: str
    """UTC, ISO 8601, to the second."""

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host!r}, started {self.started_at}"


@dataclass(frozen=True)
class Superseded:
    """What accepting a branch deleted: the old history after the branch point."""

    step: int
    checkpoints: list[Path] = field(default_factory=list)
    exports: list[Path] = field(default_factory=list)
    metrics_lines: int = 0


@dataclass
class RunDirClaim:
    """A held run folder (``hold_run_dir``); ``accept`` makes it this run's."""

    run_dir: Path
    holder: Holder
    accepted: bool = False
    superseded: Superseded | None = None

    def accept(self, cfg: PPOConfig) -> Path:
        """Write ``run.json`` at the run's first launch and delete what a branch
        supersedes (module docstring); returns ``run_dir``. ``cfg`` is the launch's
        resolved config (``resolve_resume``: ``latest`` is a folder or None)."""
        run_dir = self.run_dir
        resume = cfg.trainer.resume_from
        checkpoint = Path(resume).resolve() if resume else None
        marker = run_dir / MARKER_FILE
        if not marker.exists():
            branched = checkpoint is not None and (
                checkpoint.parent != (run_dir / CHECKPOINTS_DIR).resolve()
            )
            record = {
                "format": MARKER_FORMAT,
                "started_from": str(checkpoint) if branched else None,
                "launched_by": dataclasses.asdict(self.holder),
            }
            write_file(marker, json.dumps(record, indent=1).encode() + b"\n")
            fsync_dir(run_dir)
        if checkpoint is not None:
            self.superseded = supersede_later(cfg, checkpoint)
        self.accepted = True
        return run_dir


@contextlib.contextmanager
def hold_run_dir(cfg: PPOConfig) -> Iterator[RunDirClaim]:
    """Create ``trainer.run_dir`` and hold its lock until the block ends; refuse with
    ``ConfigValidationError`` on ``trainer.run_dir`` naming the launch that holds it,
    or when ``check_run_dir`` refuses the folder as it is now."""
    run_dir = Path(cfg.trainer.run_dir)
    check_run_dir_path(cfg.trainer.run_dir)
    created = _make_dirs(run_dir)
    claim: RunDirClaim | None = None
    fd = None
    try:
        fd = _lock(run_dir / LOCK_FILE)
        holder = Holder(
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(dataclasses.asdict(holder)).encode(), 0)
        claim = RunDirClaim(run_dir=run_dir, holder=holder)
        # Again, under the lock: the folder may have changed since validation (a run
        # that held it then has finished, say).
        check_run_dir(cfg.trainer)
        yield claim
    finally:
        if fd is not None:
            # Removed while still locked: a launch that opened it meanwhile finds the
            # path gone once it gets the lock, and retries on a fresh file (_lock).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(run_dir / LOCK_FILE)
            os.close(fd)
        if claim is None or not claim.accepted:
            for folder in reversed(created):  # a refused launch leaves no folder
                with contextlib.suppress(OSError):
                    folder.rmdir()


def supersede_later(cfg: PPOConfig, checkpoint: Path) -> Superseded:
    """Delete what a launch resuming from ``checkpoint`` (step N) supersedes in its
    folder, when that folder holds checkpoints above N: those checkpoints, the exports
    of steps above N this run wrote, and the ``metrics.jsonl`` lines above N. A resume
    from the newest checkpoint (nothing above it) continues one history and deletes
    nothing: its later exports are that history's."""
    tr = cfg.trainer
    run_dir = Path(tr.run_dir)
    step = verify_checkpoint(checkpoint, hash_files=False).step
    later = [c.folder for c in list_checkpoints(run_dir / CHECKPOINTS_DIR) if c.step > step]
    if not later:
        return Superseded(step=step)
    # Refused at validation already; checked again here, where it deletes.
    check_later_checkpoints(tr, checkpoint, suggest_latest=False)
    own = str(run_dir.resolve())
    exports = [
        folder
        for export_step, folder in list_exports(export_root(tr.export_path, tr.run_dir))
        if export_step > step and (read_marker(folder) or {}).get("run_dir") == own
    ]
    # Highest first: a crash part way leaves the lowest of them, and the next launch's
    # overwrite check still sees it.
    for folder in sorted(later, reverse=True) + exports:
        _delete(folder)
    dropped = drop_steps_after(run_dir / METRICS_FILE, step)
    drop_dumps_after(run_dir, step)
    logger.warning(
        "trainer.overwrite_later_checkpoints: resuming from step %d deleted the later "
        "history of %s: checkpoints %s, exports %s, %d metrics lines",
        step,
        run_dir,
        [p.name for p in later],
        [p.name for p in exports],
        dropped,
    )
    return Superseded(step=step, checkpoints=later, exports=exports, metrics_lines=dropped)


# --------------------------------------------------------------------------- helpers


def _make_dirs(run_dir: Path) -> list[Path]:
    """``mkdir -p run_dir``; returns the folders it created, outermost first."""
    missing = []
    folder = run_dir
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    return list(reversed(missing))


def _lock(path: Path) -> int:
    """An fd of ``path`` holding its exclusive lock; refuses naming the holder when
    another launch has it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _wait_for_holder(fd)
            os.close(fd)
            raise ConfigValidationError(
                _KEY,
                expected="a folder no other launch is using (wait for it to end, or pick "
                "a new trainer.run_dir)",
                got=f"{str(path.parent)!r}, held by the launch of "
                f"{holder.describe() if holder else 'a process that has not recorded itself yet'}"
                f" ({LOCK_FILE})",
            ) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise ConfigValidationError(
                    _KEY,
                    expected="a folder on a file system with file locks (flock)",
                    got=f"{str(path.parent)!r}: {exc}",
                ) from exc
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder before us removed it as it released: try the new one


def _wait_for_holder(fd: int, *, timeout_s: float = 2.0) -> Holder | None:
    """The holder's record, waiting briefly for it: the holder writes it just after it
    takes the lock, and a launch started at the same moment read an empty file between
    the two (seen in the two-launches test on 2 busy cores)."""
    deadline = time.monotonic() + timeout_s
    while (holder := _read_holder(fd)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return holder


def _read_holder(fd: int) -> Holder | None:
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return Holder(
            pid=int(record["pid"]), host=str(record["host"]), started_at=str(record["started_at"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _delete(folder: Path) -> None:
    # Renamed first: a crash mid-delete leaves a temp folder (removed by the next save
    # or export), never a step folder with files missing.
    aside = temp_sibling(folder)
    os.rename(folder, aside)
    fsync_dir(folder.parent)
    shutil.rmtree(aside, ignore_errors=True)
