"""Routes packed by row (``PackedRouteRows``) stand for the padded rectangle everywhere the
batch goes: row selection, the workers' layouts, route checks and agreement."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from skyrl_train.dataset.batch import map_tensors, slice_batch
from skyrl_train.dataset.route_rows import PackedRouteRows
from skyrl_train.errors import RouteReplayError
from skyrl_train.workers import routes as route_checks
from skyrl_train.workers.batch_layout import make_contiguous
from skyrl_train.workers.packed_layout import pack_rows

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from _megatron_batches import make_batch  # noqa: E402

LAYERS, EXPERTS, TOP_K = 2, 6, 2


class _Routers:
    num_layers, num_experts, top_k = LAYERS, EXPERTS, TOP_K

    def describe_layer(self, route_layer: int) -> str:
        return f"layer {route_layer}"


def _batch(*, uncaptured: int = 1):
    rng = np.random.default_rng(0)
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    responses = [[11, 12], [13, 14, 15, 16, 17], [18], [19, 20, 21]]
    routes = [
        np.stack(
            [
                np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)])
                for _ in range(len(p) + len(r) - uncaptured)
            ]
        )
        for p, r in zip(prompts, responses, strict=True)
    ]
    return make_batch(prompts, responses, num_layers=LAYERS, top_k=TOP_K, routes=routes)


def _packed(batch):
    import dataclasses

    rows = PackedRouteRows.from_rectangle(batch.routed_experts, batch.attention_mask)
    return dataclasses.replace(batch, routed_experts=rows)


def test_rows_stand_for_the_rectangle_under_slices_indices_and_moves():
    batch = _batch()
    packed = _packed(batch)
    rows = packed.routed_experts
    assert rows.shape == tuple(batch.routed_experts.shape)
    assert torch.equal(rows.rectangle(), batch.routed_experts)
    sliced = slice_batch(packed, 1, 3).routed_experts
    # A slice is a view of the packed values: no copy on the driver's split.
    assert sliced.values.untyped_storage().data_ptr() == rows.values.untyped_storage().data_ptr()
    assert torch.equal(sliced.rectangle(), batch.routed_experts[1:3])
    order = torch.tensor([3, 0, 2, 1])
    assert torch.equal(
        map_tensors(packed, lambda t: t[order]).routed_experts.rectangle(),
        batch.routed_experts[order],
    )
    assert torch.equal(rows.to("cpu").values, rows.values)


def test_workers_layouts_agree_packed_or_padded():
    batch = _batch()
    packed = _packed(batch)
    for got, want in ((make_contiguous(packed), make_contiguous(batch)),):
        assert torch.equal(got.routes, want.routes)
        assert torch.equal(got.padding_mask, want.padding_mask)
    got, want = pack_rows(packed), pack_rows(batch)
    assert torch.equal(got.routes, want.routes)
    assert torch.equal(got.padding_mask, want.padding_mask)


def test_rows_packed_for_other_rows_are_refused():
    batch = _batch()
    packed = _packed(batch)
    swapped = map_tensors(packed, lambda t: t)
    swapped.routed_experts = packed.routed_experts[torch.tensor([1, 0, 2, 3])]
    with pytest.raises(RouteReplayError, match=r"routed_experts\.(starts|lengths)"):
        make_contiguous(swapped)
    with pytest.raises(RouteReplayError, match=r"routed_experts\.(starts|lengths)"):
        pack_rows(swapped)


@pytest.mark.parametrize("bad", ["range", "repeat"])
def test_route_checks_name_the_same_row_and_token_packed_or_padded(bad):
    batch = _batch()
    broken = batch.routed_experts.clone()
    row, column = 2, int(batch.attention_mask[2].nonzero()[1])
    if bad == "range":
        broken[row, column, 1, 0] = EXPERTS
    else:
        broken[row, column, 1, 1] = broken[row, column, 1, 0]
    padded = map_tensors(batch, lambda t: t)
    padded.routed_experts = broken
    messages = []
    for candidate in (padded, _packed(padded)):
        with pytest.raises(RouteReplayError) as info:
            route_checks.validate_routes(candidate.routed_experts, _Routers())
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert f"batch row {row}, layer 1, token {column}" in messages[0]
    # The batch's good rows are untouched by the refusal.
    assert torch.equal(broken[:2], batch.routed_experts[:2])


def test_agreement_is_the_same_packed_or_padded():
    batch = _batch()
    captured = batch.routed_experts.clone()
    captured[0, int(batch.attention_mask[0].nonzero()[0]), 0] = torch.tensor([4, 5])
    got = route_checks.rollout_agreement(_packed(batch), captured, _Routers())
    want = route_checks.rollout_agreement(batch, captured, _Routers())
    assert got == want
    assert got.agreement < 1.0


def test_a_bad_packing_is_refused_naming_the_field():
    values = torch.zeros(5, LAYERS, TOP_K, dtype=torch.int64)
    with pytest.raises(ValueError, match="cu_seqlens: expected to span the 5"):
        PackedRouteRows(
            values=values, cu_seqlens=torch.tensor([0, 2, 4]), starts=torch.tensor([0, 0]), width=4
        )
    with pytest.raises(ValueError, match=r"values: expected \[T, L, K\]"):
        PackedRouteRows(
            values=values[0], cu_seqlens=torch.tensor([0, 2]), starts=torch.tensor([0]), width=4
        )
