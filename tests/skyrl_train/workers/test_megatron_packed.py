"""Packed microbatches on the Megatron backend (``trainer.remove_microbatch_padding``),
on one rank: the per-document core attention, the tail a layout adds, and the packed
worker against the padded one on the same batch and weights (the built-in model and
the four checkpoint families). The multi-rank layouts (TP=2 with SP, EP=2 on both
dispatchers with rows that differ per rank, TP=2 x EP=2, PP=2 x VPP=2) run in the
existing launches: ``test_megatron_tensor_parallel.py`` and
``test_megatron_expert_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
from _layout_checks import REORDERED, TOL, batch, checkpoint, compare, run_case
from _megatron_batches import PAD_ID, random_routes

from skyrl_train.workers.batch_layout import split_microbatches
from skyrl_train.workers.megatron.packed_rows import pack_microbatches
from skyrl_train.workers.megatron.pipeline import PipelineGroup
from skyrl_train.workers.microbatches import MicrobatchPlan
from skyrl_train.workers.packed_layout import document_attention

NO_PIPELINE = PipelineGroup(size=1, rank=0, virtual_stages=None)


def _block_causal(cu: list[int], total: int) -> torch.Tensor:
    """[T, T] True where attention is allowed: causal inside each document."""
    doc = torch.zeros(total, dtype=torch.int64)
    for d, (a, b) in enumerate(zip(cu, cu[1:], strict=False)):
        doc[a:b] = d
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return causal & (doc[:, None] == doc[None, :])


def test_document_attention_keeps_to_each_document_and_a_wider_mask_shows() -> None:
    gen = torch.Generator().manual_seed(0)
    total, heads, groups, dim = 9, 4, 2, 8
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, groups, dim, generator=gen)
    v = torch.randn(total, groups, dim, generator=gen)
    cu = [0, 3, 7, 9]
    got = document_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), scale=dim**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=_block_causal(cu, total),
        scale=dim**-0.5,
    )
    assert (got - ref.transpose(0, 1).reshape(total, -1)).abs().max() <= 1e-6
    # Widened by one token: row 2's first token (position 3) may see row 1's last.
    wide = _block_causal(cu, total)
    wide[3, 2] = True
    widened = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=wide,
        scale=dim**-0.5,
    ).transpose(0, 1)
    assert (got[3] - widened[3].reshape(-1)).abs().max() > 1e-3
    assert (got[4:] - widened[4:].reshape(total - 4, -1)).abs().max() <= 1e-6


def test_document_attention_refuses_boundaries_that_do_not_cover_the_row() -> None:
    x = torch.zeros(5, 2, 4)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected 0 \.\. 5 non-decreasing"):
        document_attention(x, x, x, torch.tensor([0, 3], dtype=torch.int32), scale=1.0)


def test_sequence_parallel_tail_stays_out_of_replay_scoring_and_routes() -> None:
    # The layout tests' batch: its first train microbatch (rows 0-1) holds 7 + 8 = 15
    # tokens, so TP=2 with sequence parallelism pads it to 16 (the 2-rank test runs it).
    rollout = batch(random_routes(4, 9, 2, 8, 2, seed=11))
    micro = split_microbatches(rollout, 2)
    (first, second) = pack_microbatches(micro, NO_PIPELINE, pad_token_id=PAD_ID, sequence_shards=2)
    assert first.real_tokens == 15 and first.tokens.shape == (1, 16)
    assert second.real_tokens == 12 and second.tokens.shape == (1, 12)  # no tail needed
    # The tail: its own document, padding for the routers, pad tokens, filler routes.
    assert first.cu_seqlens.tolist() == [0, 7, 15, 16]
    assert bool(first.padding_mask[0, 15]) and int(first.tokens[0, 15]) == PAD_ID
    assert first.positions[0, 15] == 0
    # No log-prob reads the tail (nor predicts it).
    _rows, positions = first.response_index(rollout.num_actions)
    assert int(positions.max()) + 1 < 15
    # Routes captured on the tail never reach the batch layout (agreement, R2).
    captured = torch.randint(0, 8, (1, 16, 2, 2))
    poisoned = captured.clone()
    poisoned[0, 15] = 7
    assert torch.equal(first.to_batch_layout(captured), first.to_batch_layout(poisoned))


def test_expert_exchange_refuses_ranks_that_disagree_on_the_microbatch_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from skyrl_train.workers.megatron import packed_rows

    def other_rank_runs_three(tensor: torch.Tensor, op: object, group: object) -> None:
        tensor.copy_(torch.tensor([3, -2]))

    monkeypatch.setattr(torch.distributed, "all_reduce", other_rank_runs_three)
    with pytest.raises(ValueError, match=r"^micro_batch_size: expected the same number"):
        packed_rows._longest_in_group([10, 12], object())


@pytest.mark.parametrize("name", ["builtin", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_packed_rows_score_and_step_as_the_padded_batch(name: str) -> None:
    # Same batch and weights, fp32: the packed forward (its rows REORDERED into two
    # microbatches) and train step against the padded worker, to issue 52's bounds.
    torch.set_num_threads(1)
    arch, hf_state = checkpoint(name)
    ref = run_case(arch, {}, hf_state, r3_only=True)
    got = run_case(arch, {}, hf_state, r3_only=True, packed=True)
    assert got["attention"] == "PackedDotProductAttention" != ref["attention"]
    compare(f"{name} packed", 0, hf_state, ref, got)  # agreement 1.0, log-probs, grads...
    # Measured: at most 4.8e-7 (qwen2_moe).
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-6)
    assert got["r3_forward"] == got["r3_step"] == 1.0
    assert TOL == 1e-5


def test_a_reordering_plan_returns_rows_and_routes_in_batch_order() -> None:
    # REORDERED groups rows (1, 3) and (0, 2): results must not come back as 1, 3, 0, 2.
    assert REORDERED.order().tolist() == [1, 3, 0, 2] and not REORDERED.is_consecutive
    parts = [torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [2.0]])]
    assert REORDERED.in_batch_order(parts).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert MicrobatchPlan.by_rows(4, 2).in_batch_order(parts).flatten().tolist() == [1, 3, 0, 2]


def test_packed_attention_keeps_query_key_layer_scaling() -> None:
    # The scores are divided by the layer number and the softmax multiplies it back:
    # a packed attention using the divided scale alone would be off from layer 2 on.
    torch.set_num_threads(1)
    arch, hf_state = checkpoint("builtin")
    scaled = {"transformer_config_kwargs": {"apply_query_key_layer_scaling": True}}
    ref = run_case(arch, scaled, hf_state, r3_only=True)
    got = run_case(arch, scaled, hf_state, r3_only=True, packed=True)
    compare("builtin packed, query-key layer scaling", 0, hf_state, ref, got)


def test_a_sliding_window_is_refused_packed_without_transformer_engine() -> None:
    from skyrl_train.errors import ConfigValidationError

    arch, hf_state = checkpoint("builtin")
    window = {"transformer_config_kwargs": {"window_size": (4, 0)}}
    with pytest.raises(
        ConfigValidationError, match=r"^trainer\.remove_microbatch_padding: expected false with"
    ):
        run_case(arch, window, hf_state, r3_only=True, packed=True)


def test_a_reordering_plan_keeps_the_padded_worker_in_batch_order_too() -> None:
    from _layout_checks import _worker

    torch.set_num_threads(1)
    arch, hf_state = checkpoint("builtin")
    _mc, worker = _worker(arch, {})
    worker.load_weights(hf_state.items())
    layers, experts, top_k = len(arch.moe_layers), arch.num_experts, arch.num_experts_per_tok
    rollout = batch(random_routes(4, 9, layers, experts, top_k, seed=11))
    whole = worker.forward(rollout, capture_routes=True, entropy=True)
    regrouped = worker.forward(
        rollout, capture_routes=True, entropy=True, micro_batch_size=REORDERED
    )
    # Other widths per microbatch reorder fp32 sums (measured: 1.9e-6); rows swapped
    # would be whole nats off.
    assert (regrouped.logprobs - whole.logprobs).abs().max() <= TOL
    assert (regrouped.entropy - whole.entropy).abs().max() <= TOL
    real = ~rollout.router_padding_mask
    assert torch.equal(regrouped.routes[real], whole.routes[real])
