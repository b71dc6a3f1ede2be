"""fill_batch_rows: coverage, threading, error propagation, argument checks."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from skyrl_train.utils import parallel
from skyrl_train.utils.cpu_topology import pool_workers
from skyrl_train.utils.parallel import default_fill_workers, fill_batch_rows


@pytest.mark.parametrize("workers", [None, 1, 2, 3, 8])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 5, 64])
def test_every_index_exactly_once(workers: int | None, num_rows: int) -> None:
    seen: Counter[int] = Counter()
    lock = threading.Lock()

    def fill(i: int) -> None:
        with lock:
            seen[i] += 1

    fill_batch_rows(fill, num_rows, workers=workers)
    assert seen == Counter(range(num_rows))


def test_one_worker_runs_in_order_on_the_callers_thread() -> None:
    calls: list[tuple[int, int]] = []
    fill_batch_rows(lambda i: calls.append((i, threading.get_ident())), 6, workers=1)
    assert calls == [(i, threading.get_ident()) for i in range(6)]


def test_two_workers_run_concurrently() -> None:
    # Both of the first two rows wait for each other: this only completes if two
    # threads run rows at the same time.
    barrier = threading.Barrier(2, timeout=20)
    threads: set[int] = set()

    def fill(i: int) -> None:
        threads.add(threading.get_ident())
        if i < 2:
            barrier.wait()

    fill_batch_rows(fill, 10, workers=2)
    assert len(threads) == 2
    assert threading.get_ident() in threads  # the caller's thread works too


def test_exception_of_lowest_failing_index_propagates_and_threads_are_joined() -> None:
    before = threading.active_count()
    started: list[int] = []

    def fill(i: int) -> None:
        started.append(i)
        if i >= 2:
            raise RuntimeError(f"row {i} broke")

    with pytest.raises(RuntimeError, match=r"^row 2 broke$"):
        fill_batch_rows(fill, 50, workers=2)
    assert threading.active_count() == before
    assert {0, 1, 2} <= set(started)
    assert len(started) < 50  # no new rows after the failure


def test_serial_exception_propagates() -> None:
    def fill(i: int) -> None:
        raise KeyError(i)

    with pytest.raises(KeyError):
        fill_batch_rows(fill, 3, workers=1)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("nope", 3), {}, TypeError, r"fill_row: expected a callable, got str"),
        ((print, -1), {}, ValueError, r"num_rows: expected an int >= 0, got -1"),
        ((print, 2.0), {}, TypeError, r"num_rows: expected int, got float"),
        ((print, True), {}, TypeError, r"num_rows: expected int, got bool"),
        ((print, 3), {"workers": 0}, ValueError, r"workers: expected an int >= 1, got 0"),
        ((print, 3), {"workers": True}, TypeError, r"workers: expected int or None, got bool"),
        ((print, 3), {"workers": "2"}, TypeError, r"workers: expected int or None, got str"),
    ],
)
def test_argument_errors(args: tuple, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fill_batch_rows(*args, **kwargs)


def test_default_workers_come_from_pool_workers_once() -> None:
    expected = pool_workers(cap=parallel.FILL_WORKERS_CAP, reserved=parallel.FILL_WORKERS_RESERVED)
    assert default_fill_workers() == expected
    assert default_fill_workers.cache_info().currsize == 1
