"""Batches and bad inputs shared by the padded and packed route collation tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from inference.wire import ROUTE_DTYPES
from skyrl_train.dataset import route_batch

__all__ = ["BAD_BATCH_ARGUMENTS", "BAD_SAMPLES", "batches", "ok", "reference", "sample"]


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


def sample(rng, rows, layers, topk, dtype, *, strided=False, readonly=False):
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
    block_bytes = draw(st.sampled_from([1, 5, 64, route_batch._BLOCK_BYTES]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    samples = [
        sample(rng, n, layers, topk, dt, strided=s, readonly=ro)
        for n, dt, (s, ro) in zip(rows, dtypes, flags, strict=True)
    ]
    return samples, prompts, responses, extra, workers, block_bytes


def ok(rows=3, layers=2, topk=2, dtype=np.uint8):
    return np.zeros((rows, layers, topk), dtype=dtype)


# Trajectory 1 of [ok(), bad, ok()] with prompts 2 and responses 3.
BAD_SAMPLES = [
    (
        [[0, 1]],
        r"routed_experts\[1\]: expected a numpy.ndarray \[rows, layers, topk\], got list",
    ),
    (ok(dtype=np.float32), r"routed_experts\[1\]\.dtype: expected one of uint8/int16/int32"),
    (ok(dtype=np.bool_), r"routed_experts\[1\]\.dtype: expected .*, got \|b1"),
    (ok(dtype=np.int64), r"routed_experts\[1\]\.dtype: expected .*, got <i8"),
    (ok(dtype=np.uint16), r"routed_experts\[1\]\.dtype: expected .*, got <u2"),
    (ok(dtype=np.dtype(">i2")), r"routed_experts\[1\]\.dtype: .*native byte order.*, got >i2"),
    (np.zeros((3, 4), np.uint8), r"routed_experts\[1\]\.shape: expected 3-D .*, got \(3, 4\)"),
    (
        ok(layers=3),
        r"routed_experts\[1\]\.shape: expected \[rows, 2, 2\] like routed_experts\[0\], got \(3, 3, 2\)",
    ),
    (ok(topk=1), r"routed_experts\[1\]\.shape: expected \[rows, 2, 2\]"),
    (
        ok(rows=0),
        r"routed_experts\[1\]\.shape\[0\]: expected 1 <= rows <= 5 \(prompt 2 \+ response 3 tokens\), got 0",
    ),
    (ok(rows=6), r"routed_experts\[1\]\.shape\[0\]: expected 1 <= rows <= 5 .*, got 6"),
]

BAD_BATCH_ARGUMENTS = [
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
        [ok()],
        {"prompt_lengths": [2, 2], "response_lengths": [3]},
        r"prompt_lengths: expected 1 entries .*, got 2",
    ),
    (
        [ok()],
        {"prompt_lengths": [2], "response_lengths": [-1]},
        r"response_lengths\[0\]: expected an int >= 0, got -1",
    ),
    (
        [ok()],
        {"prompt_lengths": [2.0], "response_lengths": [3]},
        r"prompt_lengths\[0\]: expected an int >= 0, got 2.0",
    ),
    (
        [ok()],
        {"prompt_lengths": [2], "response_lengths": [3], "prompt_width": 1},
        r"prompt_width: expected an int >= 2 .*, got 1",
    ),
    (
        [ok()],
        {"prompt_lengths": [2], "response_lengths": [3], "response_width": 2},
        r"response_width: expected an int >= 3 .*, got 2",
    ),
    (
        [ok(topk=300, dtype=np.uint8)],
        {"prompt_lengths": [2], "response_lengths": [3]},
        r"routed_experts\[0\]\.shape\[2\]: expected topk <= 256 for uint8, got 300",
    ),
]


def large_case():
    """``(samples, lengths kwargs)``: 48 layers x top-8 uint8, rows long enough that one
    trajectory spans several 256 KiB copy blocks."""
    rng = np.random.default_rng(0)
    prompts, responses = [300, 17, 1200, 5], [900, 1000, 3, 640]
    samples = [
        rng.integers(0, 64, size=(p + r - 1, 48, 8), dtype=np.uint8)
        for p, r in zip(prompts, responses, strict=True)
    ]
    return samples, {"prompt_lengths": prompts, "response_lengths": responses}
