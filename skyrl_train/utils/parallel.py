"""Fill the rows of a batch buffer on a small thread pool.

Threads (not processes) because the work is large NumPy slice copies, which release
the GIL, into one shared preallocated buffer; processes would have to copy the
result back. Each callback must write disjoint rows, so the rows need no locking;
the only shared state is the next-index counter.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from skyrl_train.utils.cpu_topology import pool_workers

__all__ = ["check_workers", "default_fill_workers", "fill_batch_rows"]

# Memory-bound copies stop scaling once a few threads saturate the memory controller,
# so more than 8 only adds contention with the actors sharing the node.
FILL_WORKERS_CAP = 8
# One core stays free for the node's Ray services (raylet, GCS, the object store),
# which otherwise stall behind a saturated pool.
FILL_WORKERS_RESERVED = 1


@functools.lru_cache(maxsize=1)
def default_fill_workers() -> int:
    """``pool_workers(cap=8, reserved=1)``, computed once per process."""
    return pool_workers(cap=FILL_WORKERS_CAP, reserved=FILL_WORKERS_RESERVED)


def check_workers(workers: object) -> None:
    """Raise unless ``workers`` is None or an int >= 1 (callers check it up front)."""
    if workers is None:
        return
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise TypeError(f"workers: expected int or None, got {type(workers).__name__}")
    if workers < 1:
        raise ValueError(f"workers: expected an int >= 1, got {workers}")


def _check_args(fill_row: object, num_rows: object, workers: object) -> None:
    if not callable(fill_row):
        raise TypeError(f"fill_row: expected a callable, got {type(fill_row).__name__}")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int):
        raise TypeError(f"num_rows: expected int, got {type(num_rows).__name__}")
    if num_rows < 0:
        raise ValueError(f"num_rows: expected an int >= 0, got {num_rows}")
    check_workers(workers)


def fill_batch_rows(
    fill_row: Callable[[int], object], num_rows: int, *, workers: int | None = None
) -> None:
    """Call ``fill_row(i)`` once for every ``i`` in ``range(num_rows)``.

    With one worker (or at most one row) the calls run serially on the caller's
    thread, in index order. Otherwise ``min(workers, num_rows)`` threads (the
    caller's plus helpers) take the next unclaimed index until none is left, so a
    thread slowed by a neighbour on a shared node simply fills fewer rows. If a call
    raises, no further rows are started, running ones finish (no thread writes into
    the caller's buffers after this returns) and the exception of the lowest failing
    index is re-raised.
    """
    _check_args(fill_row, num_rows, workers)
    if workers is None:
        workers = default_fill_workers()
    workers = min(workers, num_rows)
    if workers <= 1:
        for index in range(num_rows):
            fill_row(index)
        return

    claim = threading.Lock()
    next_index = 0
    errors: dict[int, BaseException] = {}

    def drain() -> None:
        nonlocal next_index
        while True:
            with claim:
                if errors or next_index >= num_rows:
                    return
                index = next_index
                next_index += 1
            try:
                fill_row(index)
            except BaseException as exc:  # re-raised on the caller's thread below
                with claim:
                    errors[index] = exc
                return

    # One task per helper thread rather than one per row: per-row futures cost tens
    # of microseconds each, and the caller's thread works too instead of waiting.
    helpers = [
        threading.Thread(target=drain, name=f"fill_batch_rows-{n}", daemon=True)
        for n in range(workers - 1)
    ]
    for thread in helpers:
        thread.start()
    try:
        drain()
    finally:
        for thread in helpers:
            thread.join()
    if errors:
        raise errors[min(errors)]
