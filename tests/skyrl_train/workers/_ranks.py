"""Running a test's ranks as processes (``torch.multiprocessing``), shared by the
multi-rank worker tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(main: Callable[..., None], *, args: tuple[Any, ...], nprocs: int) -> None:
    """``main(rank, *args)`` on ``nprocs`` spawned processes, until all end; a failed
    rank raises here (torch stops the others).

    A timeout or Ctrl-C lands in this process while the ranks run on: they are stopped
    on the way out, or they keep a core busy for the next tests (when an old 120 s limit
    fired, the ranks ran on and pytest waited 49 s for them at exit)."""
    ranks = mp.start_processes(main, args=args, nprocs=nprocs, join=False)
    try:
        while not ranks.join():
            pass
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.terminate()
        for process in ranks.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
