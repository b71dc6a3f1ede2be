"""collate_routed_experts: bit-identical to a per-token NumPy reference; loud errors."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.wire import ROUTE_DTYPES, route_filler
from skyrl_train.dataset import routes as routes_module
from skyrl_train.dataset.routes import collate_routed_experts, prepare_route_collation
from skyrl_train.errors import CollationError


def reference(routes, prompts, responses, p_width=None, r_width=None):
    """Token by token: route row t goes to the column where token t sits."""
    p_width = max(prompts) if p_width is None else p_width
    r_width = max(responses) if r_width is None else r_width
    _, layers, topk = routes[0].shape
    dtype = np.result_type(*[r.dtype for r in routes])
    out = np.empty((len(routes), p_width + r_width, layers, topk), dtype=dtype)
    out[...] = np.arange(topk)
    mask = np.ones((len(routes), p_width + r_width), dtype=bool)
    for i, sample in enumerate(routes):
        for t in range(sample.shape[0]):
            col = p_width - prompts[i] + t if t < prompts[i] else p_width + t - prompts[i]
            out[i, col] = sample[t]
            mask[i, col] = False
    return out, mask


def _sample(rng, rows, layers, topk, dtype, *, strided=False, readonly=False):
    high = min(np.iinfo(dtype).max, 300) + 1
    if strided:  # a non-contiguous view: every other row and reversed experts
        arr = rng.integers(0, high, size=(2 * rows, layers, topk), dtype=dtype)[::2, :, ::-1]
        assert not arr.flags.c_contiguous or rows * topk <= 1
    else:
        arr = rng.integers(0, high, size=(rows, layers, topk), dtype=dtype)
    if readonly:
        arr.flags.writeable = False
    return arr


@st.composite
def batches(draw):
    batch = draw(st.integers(1, 5))
    layers = draw(st.integers(1, 3))
    topk = draw(st.integers(1, 4))
    prompts = draw(st.lists(st.integers(1, 7), min_size=batch, max_size=batch))
    responses = draw(st.lists(st.integers(0, 7), min_size=batch, max_size=batch))
    rows = [draw(st.integers(1, p + r)) for p, r in zip(prompts, responses, strict=True)]
    dtypes = draw(st.lists(st.sampled_from(ROUTE_DTYPES), min_size=batch, max_size=batch))
    flags = draw(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=batch, max_size=batch))
    extra = draw(st.tuples(st.integers(0, 2), st.integers(0, 2)))
    workers = draw(st.sampled_from([1, 2, 3]))
    # Copy blocks from one row (1 byte) to the default: pieces split into many blocks.
    block_bytes = draw(st.sampled_from([1, 5, 64, routes_module._BLOCK_BYTES]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    samples = [
        _sample(rng, n, layers, topk, dt, strided=s, readonly=ro)
        for n, dt, (s, ro) in zip(rows, dtypes, flags, strict=True)
    ]
    return samples, prompts, responses, extra, workers, block_bytes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_matches_reference(case) -> None:
    samples, prompts, responses, (extra_p, extra_r), workers, block_bytes = case
    p_width, r_width = max(prompts) + extra_p, max(responses) + extra_r
    with mock.patch.object(routes_module, "_BLOCK_BYTES", block_bytes):
        got = collate_routed_experts(
            samples,
            prompt_lengths=prompts,
            response_lengths=responses,
            prompt_width=p_width,
            response_width=r_width,
            workers=workers,
        )
    want, want_mask = reference(samples, prompts, responses, p_width, r_width)
    assert got.routed_experts.dtype == want.dtype
    assert got.routed_experts.shape == want.shape
    assert got.routed_experts.tobytes() == want.tobytes()  # bit-identical
    assert np.array_equal(got.router_padding_mask, want_mask)
    assert got.router_padding_mask.dtype == np.bool_


def test_mixed_dtypes_widen_and_padding_is_arange() -> None:
    a = np.full((3, 2, 4), 200, dtype=np.uint8)  # prompt 2 + response 2, last token uncaptured
    b = np.full((2, 2, 4), -300 + 1000, dtype=np.int16)
    got = collate_routed_experts([a, b], prompt_lengths=[2, 1], response_lengths=[2, 3])
    assert got.routed_experts.dtype == np.int16
    assert got.routed_experts.shape == (2, 5, 2, 4)
    assert got.routed_experts.flags.writeable and got.routed_experts.flags.c_contiguous
    assert got.router_padding_mask.tolist() == [
        [False, False, False, True, True],
        [True, False, False, True, True],
    ]
    assert (got.routed_experts[0, :3] == 200).all()
    assert (got.routed_experts[1, 1:3] == 700).all()
    for i, j in [(0, 3), (0, 4), (1, 0), (1, 3), (1, 4)]:
        assert (got.routed_experts[i, j] == np.arange(4)).all()


def test_route_filler_is_k_distinct_experts() -> None:
    filler = route_filler(8, np.int16)
    assert filler.dtype == np.int16
    assert filler.tolist() == list(range(8))


def test_large_rows_parallel_equals_serial() -> None:
    rng = np.random.default_rng(0)
    prompts, responses = [300, 17, 1200, 5], [900, 1000, 3, 640]
    # 48 layers x top-8: a 1,200-row piece spans several 256 KiB copy blocks.
    samples = [
        rng.integers(0, 64, size=(p + r - 1, 48, 8), dtype=np.uint8)
        for p, r in zip(prompts, responses, strict=True)
    ]
    kw = {"prompt_lengths": prompts, "response_lengths": responses}
    serial = collate_routed_experts(samples, **kw, workers=1)
    parallel = collate_routed_experts(samples, **kw, workers=2)
    want, want_mask = reference(samples, prompts, responses)
    assert np.array_equal(serial.routed_experts, want)
    assert np.array_equal(parallel.routed_experts, want)
    assert np.array_equal(parallel.router_padding_mask, want_mask)


def test_rows_are_filled_last_to_first_each_in_full() -> None:
    # Top-down writes reuse the lines the kernel just zeroed (22 vs 33 ms, see routes.py).
    samples = [np.full((4, 2, 3), 9, dtype=np.uint8), np.full((2, 2, 3), 7, dtype=np.uint8)]
    kw = {"prompt_lengths": [2, 1], "response_lengths": [3, 2]}
    collator = prepare_route_collation(samples, **kw)
    out = collator.result()
    out.routed_experts[...] = 255
    out.router_padding_mask[...] = False
    collator.fill_row(0)
    want, want_mask = reference(samples, [2, 1], [3, 2])
    assert (out.routed_experts[0] == 255).all() and not out.router_padding_mask[0].any()
    assert np.array_equal(out.routed_experts[1], want[1])
    assert np.array_equal(out.router_padding_mask[1], want_mask[1])


def _ok(rows=3, layers=2, topk=2, dtype=np.uint8):
    return np.zeros((rows, layers, topk), dtype=dtype)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (
            [[0, 1]],
            r"routed_experts\[1\]: expected a numpy.ndarray \[rows, layers, topk\], got list",
        ),
        (_ok(dtype=np.float32), r"routed_experts\[1\]\.dtype: expected one of uint8/int16/int32"),
        (_ok(dtype=np.bool_), r"routed_experts\[1\]\.dtype: expected .*, got \|b1"),
        (_ok(dtype=np.int64), r"routed_experts\[1\]\.dtype: expected .*, got <i8"),
        (_ok(dtype=np.uint16), r"routed_experts\[1\]\.dtype: expected .*, got <u2"),
        (_ok(dtype=np.dtype(">i2")), r"routed_experts\[1\]\.dtype: .*native byte order.*, got >i2"),
        (np.zeros((3, 4), np.uint8), r"routed_experts\[1\]\.shape: expected 3-D .*, got \(3, 4\)"),
        (
            _ok(layers=3),
            r"routed_experts\[1\]\.shape: expected \[rows, 2, 2\] like routed_experts\[0\], got \(3, 3, 2\)",
        ),
        (_ok(topk=1), r"routed_experts\[1\]\.shape: expected \[rows, 2, 2\]"),
        (
            _ok(rows=0),
            r"routed_experts\[1\]\.shape\[0\]: expected 1 <= rows <= 5 \(prompt 2 \+ response 3 tokens\), got 0",
        ),
        (_ok(rows=6), r"routed_experts\[1\]\.shape\[0\]: expected 1 <= rows <= 5 .*, got 6"),
    ],
)
def test_bad_sample_names_the_trajectory(bad, match, monkeypatch) -> None:
    # Validation precedes any copy: the fill must never start.
    monkeypatch.setattr(routes_module, "fill_batch_rows", _no_fill)
    with pytest.raises(CollationError, match=match):
        collate_routed_experts(
            [_ok(), bad, _ok()], prompt_lengths=[2, 2, 2], response_lengths=[3, 3, 3]
        )


def _no_fill(*args, **kwargs):
    raise AssertionError("rows were filled before validation finished")


def test_torch_tensor_is_refused() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(CollationError, match=r"routed_experts\[0\]: .*got Tensor"):
        collate_routed_experts(
            [torch.zeros(2, 1, 1, dtype=torch.uint8)], prompt_lengths=[1], response_lengths=[1]
        )


@pytest.mark.parametrize(
    ("routes", "kwargs", "match"),
    [
        (
            [],
            {"prompt_lengths": [], "response_lengths": []},
            r"routed_experts: expected at least one trajectory, got 0",
        ),
        (
            np.zeros((1, 2, 1, 1), np.uint8),
            {"prompt_lengths": [1], "response_lengths": [1]},
            r"routed_experts: expected a list",
        ),
        (
            [_ok()],
            {"prompt_lengths": [2, 2], "response_lengths": [3]},
            r"prompt_lengths: expected 1 entries .*, got 2",
        ),
        (
            [_ok()],
            {"prompt_lengths": [2], "response_lengths": [-1]},
            r"response_lengths\[0\]: expected an int >= 0, got -1",
        ),
        (
            [_ok()],
            {"prompt_lengths": [2.0], "response_lengths": [3]},
            r"prompt_lengths\[0\]: expected an int >= 0, got 2.0",
        ),
        (
            [_ok()],
            {"prompt_lengths": [2], "response_lengths": [3], "prompt_width": 1},
            r"prompt_width: expected an int >= 2 .*, got 1",
        ),
        (
            [_ok()],
            {"prompt_lengths": [2], "response_lengths": [3], "response_width": 2},
            r"response_width: expected an int >= 3 .*, got 2",
        ),
        (
            [_ok(topk=300, dtype=np.uint8)],
            {"prompt_lengths": [2], "response_lengths": [3]},
            r"routed_experts\[0\]\.shape\[2\]: expected topk <= 256 for uint8, got 300",
        ),
    ],
)
def test_bad_batch_arguments(routes, kwargs, match) -> None:
    with pytest.raises(CollationError, match=match):
        collate_routed_experts(routes, **kwargs)


def test_bad_workers_fail_before_validation_or_copy(monkeypatch) -> None:
    monkeypatch.setattr(routes_module, "fill_batch_rows", _no_fill)
    with pytest.raises(ValueError, match=r"workers: expected an int >= 1, got 0"):
        collate_routed_experts([_ok()], prompt_lengths=[2], response_lengths=[3], workers=0)
