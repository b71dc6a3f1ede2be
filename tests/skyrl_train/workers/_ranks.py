"""The multi-rank worker tests' ranks and process groups, in one place.

``run_group`` is how a multi-rank test runs: ``main(rank, *args)`` on spawned
processes (``torch.multiprocessing``), each with one thread (``OMP_NUM_THREADS=1``
when it imports torch, and ``torch.set_num_threads(1)``), inside one gloo group of
all of them joined through a file rendezvous (no port to race other test processes
for), which each rank leaves on the way out, passed or failed. The workers build the
rest on that group in ``setup()`` (Megatron's parallel state, FSDP's device mesh), so
no test repeats it. ``one_rank_group`` is the same group for a test in this process,
world size 1. ``run_ranks`` is the bare launcher both stand on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
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


def run_group(
    main: Callable[..., None], *, args: tuple[Any, ...], nprocs: int, rendezvous: Path
) -> None:
    """``main(rank, *args)`` on ``nprocs`` ranks of one gloo group (the module's
    docstring); ``rendezvous`` is a file path no other launch uses (a test's
    ``tmp_path / "rendezvous"``)."""
    # Spawned ranks read the variable when they import torch; restored after, so the
    # test process keeps its own setting.
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        run_ranks(_in_group, args=(main, str(rendezvous), nprocs, args), nprocs=nprocs)
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _in_group(
    rank: int, main: Callable[..., None], rendezvous: str, world: int, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
    )
    try:
        main(rank, *args)
    finally:
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """This process alone as a gloo group (an in-memory store) for the block, left on
    exit; a group that already exists (a Megatron worker's) is used and left as is."""
    dist = torch.distributed
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
