"""The Megatron worker's response scoring (``layout.response_logprobs_and_entropy``) is
the backend-neutral one (``algorithms/sampler_replay``): bit for bit on a whole
vocabulary, and, split over two vocabulary shards (``layout.VocabShard``: tensor
parallelism's column-parallel output layer), equal to it in log-probs, entropy and
the logits' gradient through its hand-written backward. The two shards run in one
process, each on its own thread with its own gloo group over one in-memory store. A
padded vocabulary (rows Megatron adds so TP divides it) scores as the unpadded one."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

from skyrl_train.algorithms import SamplerReplay, sampler_log_probs_and_entropy
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.workers.megatron.groups import init_distributed
from skyrl_train.workers.megatron.layout import (
    ContiguousBatch,
    VocabShard,
    make_contiguous,
    response_logprobs,
    response_logprobs_and_entropy,
)

V = 12
HALF = V // 2


def _batch() -> TrainingBatch:
    # Row 0: prompt of 2 (left-padded by 1), response of 3; row 1: prompt 3, response 2.
    sequences = torch.tensor([[0, 5, 6, 1, 2, 8], [7, 8, 9, 4, 10, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    response = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # Kept sets across both shards ([0, 6) and [6, 12)), each holding its sampled token;
    # the last row lists none (padding): the whole vocabulary.
    support = torch.tensor(
        [
            [[1, 4, 7, -1], [2, 0, 11, -1], [8, 9, 10, 5]],
            [[4, 2, -1, -1], [10, -1, -1, -1], [-1, -1, -1, -1]],
        ]
    )
    return TrainingBatch(
        sequences=sequences,
        attention_mask=attention,
        response_mask=response,
        loss_mask=response.clone(),
        rewards=torch.zeros(2),
        token_rewards=torch.zeros(2, 3),
        sample_support=support,
    )


def _rows(logits: torch.Tensor, layout: ContiguousBatch, num_actions: int) -> tuple[Any, Any]:
    """The logits that predict each response token, ``[B, R, V]``, and those tokens."""
    target = (layout.prompt_lens[:, None] + torch.arange(num_actions)[None, :]).clamp(
        max=layout.tokens.shape[1] - 1
    )
    picked = logits.gather(1, (target - 1)[:, :, None].expand(-1, -1, logits.shape[-1]))
    return picked, layout.tokens.gather(1, target)


def test_one_shard_is_the_algorithms_scoring_bit_for_bit() -> None:
    batch = _batch()
    layout = make_contiguous(batch)
    logits = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(0)) * 3
    sampler = SamplerReplay(temperature=0.7, support=batch.sample_support)
    whole = VocabShard(start=0, size=V, vocab=V)
    lp, ent = response_logprobs_and_entropy(
        logits, layout, batch.response_mask, sampler=sampler, shard=whole
    )
    picked, targets = _rows(logits, layout, batch.num_actions)
    want_lp, want_ent = sampler_log_probs_and_entropy(picked, targets, sampler=sampler)
    mask = batch.response_mask.float()
    assert torch.equal(lp, want_lp * mask) and torch.equal(ent, want_ent * mask)
    alone = response_logprobs(logits, layout, batch.response_mask, sampler=sampler, shard=whole)
    assert torch.equal(alone, lp)


def _run_shard(rank: int, store: Any, case: tuple[Any, ...], out: dict[int, Any]) -> None:
    logits, weights, batch, real = case
    try:
        group = torch.distributed.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
        mine = logits[..., rank * HALF : (rank + 1) * HALF].detach().clone().requires_grad_(True)
        shard = VocabShard(start=rank * HALF, size=HALF, vocab=V, group=group, real_vocab=real)
        sampler = SamplerReplay(temperature=0.7, support=batch.sample_support)
        lp, ent = response_logprobs_and_entropy(
            mine, make_contiguous(batch), batch.response_mask, sampler=sampler, shard=shard
        )
        # Both ranks' losses are the same function of the all-reduced values.
        (lp * weights).sum().add((ent * weights.flip(0)).sum()).backward()
        out[rank] = (lp.detach(), ent.detach(), mine.grad)
    except BaseException as error:  # surfaced by the main thread's assertion
        out[rank] = error


def _on_two_shards(
    logits: torch.Tensor, weights: torch.Tensor, batch: TrainingBatch, real: int | None = None
) -> dict[int, Any]:
    """Each half of the vocabulary's (log-probs, entropy, logit gradient), two gloo ranks
    on threads; ``real``: the checkpoint's vocabulary when the rows past it are padding."""
    store = torch.distributed.HashStore()
    out: dict[int, Any] = {}
    case = (logits, weights, batch, real)
    threads = [threading.Thread(target=_run_shard, args=(r, store, case, out)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(isinstance(out.get(r), tuple) for r in range(2)), out
    return out


def test_two_vocabulary_shards_equal_the_whole_vocabulary() -> None:
    if not torch.distributed.is_initialized():
        # megatron-core's reduce reads the default group's state before using ours.
        init_distributed(rank=0, world_size=1, init_method="env://")
    batch = _batch()
    logits = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(1)) * 3
    weights = torch.randn(2, 3, generator=torch.Generator().manual_seed(2))
    out = _on_two_shards(logits, weights, batch)

    full = logits.clone().requires_grad_(True)
    layout = make_contiguous(batch)
    picked, targets = _rows(full, layout, batch.num_actions)
    sampler = SamplerReplay(temperature=0.7, support=batch.sample_support)
    lp, ent = sampler_log_probs_and_entropy(picked, targets, sampler=sampler)
    mask = batch.response_mask.float()
    lp, ent = lp * mask, ent * mask
    (lp * weights).sum().add((ent * weights.flip(0)).sum()).backward()
    assert full.grad is not None
    for rank in range(2):
        got_lp, got_ent, got_grad = out[rank]
        assert torch.allclose(got_lp, lp.detach(), atol=1e-6)
        assert torch.allclose(got_ent, ent.detach(), atol=1e-6)
        assert torch.allclose(got_grad, full.grad[..., rank * HALF : (rank + 1) * HALF], atol=1e-6)
    # The kept sets reach both shards: each one's gradient is non-zero somewhere.
    assert all(out[r][2].abs().sum() > 0 for r in range(2))


# ------------------------------------------------------------- a padded vocabulary


def _within(batch: TrainingBatch, real: int) -> TrainingBatch:
    """``batch`` with every token and kept-set id folded into ``[0, real)``, and a real
    response position (row 0's second) that lists no kept set: the whole vocabulary,
    where a padded id would count if the mask were missing."""
    support = torch.where(batch.sample_support >= 0, batch.sample_support % real, -1)
    support[0, 1] = -1
    return dataclasses.replace(batch, sequences=batch.sequences % real, sample_support=support)


@pytest.mark.parametrize("real", [11, 5])
def test_padded_ids_never_count_in_log_probs_entropy_or_gradients(real: int) -> None:
    # V=12 rows for a vocabulary of 11 (the last shard ends in one padded id) or of 5
    # (the second shard all padding). The padded logits are the largest, so counting
    # any of them would move every log-prob and the entropy.
    if not torch.distributed.is_initialized():
        init_distributed(rank=0, world_size=1, init_method="env://")
    batch = _within(_batch(), real)
    logits = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(3)) * 3
    logits[..., real:] = 40.0
    weights = torch.randn(2, 3, generator=torch.Generator().manual_seed(4))
    sampler = SamplerReplay(temperature=0.7, support=batch.sample_support)
    layout = make_contiguous(batch)
    mask = batch.response_mask.float()

    # The reference: the checkpoint's vocabulary alone, no padding anywhere.
    unpadded = logits[..., :real].clone().requires_grad_(True)
    picked, targets = _rows(unpadded, layout, batch.num_actions)
    want_lp, want_ent = sampler_log_probs_and_entropy(picked, targets, sampler=sampler)
    want_lp, want_ent = want_lp * mask, want_ent * mask
    (want_lp * weights).sum().add((want_ent * weights.flip(0)).sum()).backward()
    assert unpadded.grad is not None
    want_grad = torch.cat([unpadded.grad, torch.zeros(2, 6, V - real)], dim=-1)

    # One rank holding all 12 rows (TP=1 with make_vocab_size_divisible_by > 1).
    whole = logits.clone().requires_grad_(True)
    lp, ent = response_logprobs_and_entropy(
        whole,
        layout,
        batch.response_mask,
        sampler=sampler,
        shard=VocabShard(start=0, size=V, vocab=V, real_vocab=real),
    )
    (lp * weights).sum().add((ent * weights.flip(0)).sum()).backward()
    assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(ent, want_ent, atol=1e-6)
    assert torch.allclose(whole.grad, want_grad, atol=1e-6)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()

    # Two shards, the padding on the last one (TP=2).
    out = _on_two_shards(logits, weights, batch, real)
    for rank in range(2):
        got_lp, got_ent, got_grad = out[rank]
        assert torch.allclose(got_lp, want_lp.detach(), atol=1e-6)
        assert torch.allclose(got_ent, want_ent.detach(), atol=1e-6)
        assert torch.allclose(got_grad, want_grad[..., rank * HALF : (rank + 1) * HALF], atol=1e-6)


def test_a_shard_of_the_workers_finds_its_padding_from_the_checkpoints_vocabulary() -> None:
    # VocabShard.of outside parallel state (one rank): padded only past real_vocab.
    assert VocabShard.of(12, real_vocab=11).padded == 1
    assert VocabShard.of(12, real_vocab=12) == VocabShard(start=0, size=12, vocab=12)
    assert VocabShard.of(12).padded == 0
    assert VocabShard(start=6, size=6, vocab=12, real_vocab=5).padded == 6
    assert VocabShard(start=0, size=6, vocab=12, real_vocab=5).padded == 1
