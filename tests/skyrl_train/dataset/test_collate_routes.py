"""collate_routed_experts: bit-identical to a per-token NumPy reference; loud errors."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from inference.wire import route_filler
from skyrl_train.dataset import route_batch
from skyrl_train.dataset import routes as routes_module
from skyrl_train.dataset.routes import collate_routed_experts, prepare_route_collation
from skyrl_train.errors import CollationError
from tests.skyrl_train.dataset._route_cases import (
    BAD_BATCH_ARGUMENTS,
    BAD_SAMPLES,
    batches,
    large_case,
    ok,
    reference,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_matches_reference(case) -> None:
    samples, prompts, responses, (extra_p, extra_r), workers, block_bytes = case
    p_width, r_width = max(prompts) + extra_p, max(responses) + extra_r
    with mock.patch.object(route_batch, "_BLOCK_BYTES", block_bytes):
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
    samples, kw = large_case()
    prompts, responses = kw["prompt_lengths"], kw["response_lengths"]
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


@pytest.mark.parametrize(("bad", "match"), BAD_SAMPLES)
def test_bad_sample_names_the_trajectory(bad, match, monkeypatch) -> None:
    # Validation precedes any copy: the fill must never start.
    monkeypatch.setattr(routes_module, "fill_batch_rows", _no_fill)
    with pytest.raises(CollationError, match=match):
        collate_routed_experts(
            [ok(), bad, ok()], prompt_lengths=[2, 2, 2], response_lengths=[3, 3, 3]
        )


def _no_fill(*args, **kwargs):
    raise AssertionError("rows were filled before validation finished")


def test_torch_tensor_is_refused() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(CollationError, match=r"routed_experts\[0\]: .*got Tensor"):
        collate_routed_experts(
            [torch.zeros(2, 1, 1, dtype=torch.uint8)], prompt_lengths=[1], response_lengths=[1]
        )


@pytest.mark.parametrize(("routes", "kwargs", "match"), BAD_BATCH_ARGUMENTS)
def test_bad_batch_arguments(routes, kwargs, match) -> None:
    with pytest.raises(CollationError, match=match):
        collate_routed_experts(routes, **kwargs)


def test_bad_workers_fail_before_validation_or_copy(monkeypatch) -> None:
    monkeypatch.setattr(routes_module, "fill_batch_rows", _no_fill)
    with pytest.raises(ValueError, match=r"workers: expected an int >= 1, got 0"):
        collate_routed_experts([ok()], prompt_lengths=[2], response_lengths=[3], workers=0)
