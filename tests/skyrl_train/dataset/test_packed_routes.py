"""collate_packed_routes: the padded collation's real tokens, packed; the same refusals;
a microbatch's rectangle from the packed rows (``PackedRouteRows.rectangle``) equal to
collate_routed_experts'."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from skyrl_train.dataset import packed_routes as packed_module
from skyrl_train.dataset import route_batch
from skyrl_train.dataset.packed_routes import (
    PackedRoutes,
    collate_packed_routes,
    prepare_packed_route_collation,
)
from skyrl_train.dataset.route_rows import PackedRouteRows
from skyrl_train.dataset.routes import collate_routed_experts
from skyrl_train.errors import CollationError
from tests.skyrl_train.dataset._route_cases import (
    BAD_BATCH_ARGUMENTS,
    BAD_SAMPLES,
    batches,
    large_case,
    ok,
    reference,
)


def packed_reference(routes, prompts, responses):
    """Each trajectory's real columns of the padded reference, one after another."""
    padded, mask = reference(routes, prompts, responses)
    width = max(prompts)
    cols = [range(width - p, width + r) for p, r in zip(prompts, responses, strict=True)]
    out = np.concatenate([padded[i, list(c)] for i, c in enumerate(cols)])
    flags = np.concatenate([mask[i, list(c)] for i, c in enumerate(cols)])
    return out, flags


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_packs_the_padded_collations_real_tokens(case) -> None:
    samples, prompts, responses, (extra_p, extra_r), workers, block_bytes = case
    with mock.patch.object(route_batch, "_BLOCK_BYTES", block_bytes):
        got = collate_packed_routes(
            samples, prompt_lengths=prompts, response_lengths=responses, workers=workers
        )
        padded = collate_routed_experts(
            samples, prompt_lengths=prompts, response_lengths=responses, workers=workers
        )
    want, want_mask = packed_reference(samples, prompts, responses)
    tokens = [p + r for p, r in zip(prompts, responses, strict=True)]
    assert got.cu_seqlens.dtype == np.int64
    assert got.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(tokens)]).tolist()
    assert got.routed_experts.dtype == padded.routed_experts.dtype == want.dtype
    assert got.routed_experts.tobytes() == want.tobytes()  # bit-identical
    assert got.router_padding_mask.dtype == np.bool_
    assert np.array_equal(got.router_padding_mask, want_mask)
    # A microbatch's rectangle from the packed rows is the padded collation's rows.
    rows = list(range(len(samples)))[::-1][: max(1, len(samples) - 1)]
    p_width, r_width = max(prompts) + extra_p, max(responses) + extra_r
    route_rows = PackedRouteRows(
        values=torch.from_numpy(got.routed_experts),
        cu_seqlens=torch.from_numpy(got.cu_seqlens),
        starts=torch.tensor([p_width - p for p in prompts]),
        width=p_width + r_width,
    )
    rect = route_rows[torch.tensor(rows)].rectangle()
    direct = collate_routed_experts(
        [samples[i] for i in rows],
        prompt_lengths=[prompts[i] for i in rows],
        response_lengths=[responses[i] for i in rows],
        prompt_width=p_width,
        response_width=r_width,
    )
    # The rows keep the batch's dtype, which the subset alone may not need.
    assert rect.numpy().dtype == got.routed_experts.dtype
    want_rect = direct.routed_experts.astype(got.routed_experts.dtype)
    assert rect.numpy().tobytes() == want_rect.tobytes()


def test_mixed_dtypes_widen_and_uncaptured_tokens_are_filler() -> None:
    a = np.full((3, 2, 4), 200, dtype=np.uint8)  # prompt 2 + response 2, last token uncaptured
    b = np.full((2, 2, 4), 700, dtype=np.int16)  # prompt 1 + response 3, two uncaptured
    got = collate_packed_routes([a, b], prompt_lengths=[2, 1], response_lengths=[2, 3])
    assert isinstance(got, PackedRoutes) and got.num_sequences == 2
    assert got.routed_experts.dtype == np.int16 and got.routed_experts.shape == (8, 2, 4)
    assert got.routed_experts.flags.writeable and got.routed_experts.flags.c_contiguous
    assert got.cu_seqlens.tolist() == [0, 4, 8] and got.lengths.tolist() == [4, 4]
    assert got.router_padding_mask.tolist() == [False] * 3 + [True] + [False] * 2 + [True] * 2
    assert (got.routed_experts[:3] == 200).all() and (got.routed_experts[4:6] == 700).all()
    for t in (3, 6, 7):
        assert (got.routed_experts[t] == np.arange(4)).all()


def test_every_byte_is_written(monkeypatch) -> None:
    # np.empty hands back whatever the allocator had: two different stale fills must both
    # vanish, so no byte of either buffer is left unwritten.
    samples = [np.full((5, 3, 2), 1, np.uint8), np.full((2, 3, 2), 2, np.uint8)]
    kw = {"prompt_lengths": [3, 2], "response_lengths": [3, 4]}
    results = []
    for stale in (0x5A, 0xA5):

        def stale_empty(shape, dtype=float, stale=stale):
            return np.full(shape, stale, dtype=dtype)

        with monkeypatch.context() as patch:
            patch.setattr(np, "empty", stale_empty)
            results.append(collate_packed_routes(samples, **kw, workers=2))
    a, b = results
    assert a.routed_experts.tobytes() == b.routed_experts.tobytes()
    assert np.array_equal(a.router_padding_mask, b.router_padding_mask)
    assert a.router_padding_mask.tolist() == [False] * 5 + [True] + [False] * 2 + [True] * 4


def test_no_rectangle_is_allocated(monkeypatch) -> None:
    # The packed path's point: host memory is the packed bytes, not [B, S, L, K].
    samples = [np.ones((40, 3, 2), np.int16), np.ones((3, 3, 2), np.int16)]
    shapes = []
    real_empty = np.empty

    def recording_empty(shape, dtype=float):
        shapes.append(tuple(np.atleast_1d(shape)))
        return real_empty(shape, dtype=dtype)

    monkeypatch.setattr(np, "empty", recording_empty)
    got = collate_packed_routes(samples, prompt_lengths=[30, 2], response_lengths=[11, 2])
    monkeypatch.undo()
    packed_shape = (45, 3, 2)  # T = 41 + 4 tokens
    assert got.routed_experts.shape == packed_shape
    padding_block = [s for s in shapes if s not in {packed_shape, (45,)}]
    assert len(shapes) == 3 and len(padding_block) == 1  # routes, mask, one filler block
    assert len(padding_block[0]) == 3 and padding_block[0][1:] == (3, 2)


def test_large_rows_pooled_equals_serial() -> None:
    samples, kw = large_case()
    prompts, responses = kw["prompt_lengths"], kw["response_lengths"]
    serial = collate_packed_routes(samples, **kw, workers=1)
    want, want_mask = packed_reference(samples, prompts, responses)
    assert serial.routed_experts.tobytes() == want.tobytes()
    for workers in (2, 3):
        pooled = collate_packed_routes(samples, **kw, workers=workers)
        assert pooled.routed_experts.tobytes() == serial.routed_experts.tobytes()
        assert np.array_equal(pooled.router_padding_mask, want_mask)
        assert np.array_equal(pooled.cu_seqlens, serial.cu_seqlens)


def test_trajectories_are_filled_last_to_first_each_in_full() -> None:
    # Top-down writes reuse the lines the kernel just zeroed (22 vs 33 ms, see routes.py).
    samples = [np.full((4, 2, 3), 9, dtype=np.uint8), np.full((2, 2, 3), 7, dtype=np.uint8)]
    collator = prepare_packed_route_collation(
        samples, prompt_lengths=[2, 1], response_lengths=[3, 2]
    )
    out = collator.result()
    out.routed_experts[...] = 255
    out.router_padding_mask[...] = False
    collator.fill_row(0)
    assert (out.routed_experts[:5] == 255).all() and not out.router_padding_mask[:5].any()
    assert (out.routed_experts[5:7] == 7).all()
    assert (out.routed_experts[7] == np.arange(3)).all()
    assert out.router_padding_mask[5:].tolist() == [False, False, True]


def _no_fill(*args, **kwargs):
    raise AssertionError("rows were filled before validation finished")


@pytest.mark.parametrize(("bad", "match"), BAD_SAMPLES)
def test_bad_sample_is_refused_as_the_padded_path_does(bad, match, monkeypatch) -> None:
    batch = [ok(), bad, ok()]
    before = [np.array(x, copy=True) for x in batch]
    monkeypatch.setattr(packed_module, "fill_batch_rows", _no_fill)
    with pytest.raises(CollationError, match=match):
        collate_packed_routes(batch, prompt_lengths=[2, 2, 2], response_lengths=[3, 3, 3])
    for x, y in zip(batch, before, strict=True):  # the inputs stay as they were
        assert np.array_equal(np.asarray(x), y)


@pytest.mark.parametrize(
    ("routes", "kwargs", "match"),
    [case for case in BAD_BATCH_ARGUMENTS if not {"prompt_width", "response_width"} & {*case[1]}],
)
def test_bad_batch_arguments_are_refused_as_the_padded_path_does(routes, kwargs, match) -> None:
    with pytest.raises(CollationError, match=match):
        collate_packed_routes(routes, **kwargs)


def test_bad_workers_fail_before_validation_or_copy(monkeypatch) -> None:
    monkeypatch.setattr(packed_module, "fill_batch_rows", _no_fill)
    with pytest.raises(ValueError, match=r"workers: expected an int >= 1, got 0"):
        collate_packed_routes([ok()], prompt_lengths=[2], response_lengths=[3], workers=0)
