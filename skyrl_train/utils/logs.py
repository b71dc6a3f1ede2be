"""The launch's logging: this package's INFO lines bare on the console, written through
``tqdm.write`` so they never land inside a progress bar, and every line timestamped
in ``<run_dir>/main_base.log``.

The launch sets logging up itself rather than through Hydra's job logging: Hydra opens
its job log in the run folder before the config is validated, so a refused launch
left a ``runs/r3_grpo/`` behind. Here the file is opened only once the run folder
exists, after validation.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

LINE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
"""Every line in the job log, and non-package or non-INFO lines on the console."""


class _ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes through ``tqdm.write``, which lifts the progress bars off the terminal for
    the line and redraws them under it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


class _ConsoleFormatter(logging.Formatter):
    """This package's INFO lines bare (the per-step line reads as a plain line);
    everything else (warnings, other libraries) with time, logger and level."""

    def __init__(self) -> None:
        super().__init__("%(message)s")
        self.full = logging.Formatter(LINE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO and record.name.startswith("skyrl_train."):
            return super().format(record)
        return self.full.format(record)


@contextlib.contextmanager
def console_logging(stream: object = None) -> Iterator[None]:
    """INFO and above to ``stream`` (stdout) for the duration; the root logger's level
    and handlers are restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    handler = _ConsoleHandler(stream if stream is not None else sys.stdout)
    handler.setFormatter(_ConsoleFormatter())
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.handlers, root.level = saved


@contextlib.contextmanager
def job_log(path: Path) -> Iterator[None]:
    """Every log line, timestamped, appended to ``path`` for the duration."""
    root = logging.getLogger()
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LINE_FORMAT))
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
