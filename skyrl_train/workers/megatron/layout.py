"""Re-lay a TrainingBatch out for Megatron and map results back.

Megatron's GPTModel ignores ``position_ids`` for RoPE (always 0..S-1), so a
left-padded prompt would put every real token at the wrong rotary position. Each row
is shifted left by its prompt padding so it is contiguous from position 0 (right
padded), and its routes move with it. Response token j of row b then sits at position
``prompt_len[b] + j``; its logprob comes from the logits one position earlier.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inference.wire import route_filler
from skyrl_train.algorithms.sampler_replay import SamplerReplay, pick_targets, sampler_logits
from skyrl_train.algorithms.signals import token_entropy
from skyrl_train.dataset.batch import TrainingBatch


@dataclass(frozen=True)
class ContiguousBatch:
    tokens: torch.Tensor
    """[B, S] int64, row b's real tokens at 0..length[b]-1, pad token after."""
    shifts: torch.Tensor
    """[B] int64 left-padding removed from each row."""
    prompt_lens: torch.Tensor
    """[B] int64 real prompt tokens per row (>= 1)."""
    padding_mask: torch.Tensor
    """[B, S] bool, True on rows the routers treat as padding (Megatron's convention:
    True = padding), i.e. the moved ``router_padding_mask`` plus the right-hand filler."""
    routes: torch.Tensor | None
    """[B, S, L, K] moved with the tokens; filler rows hold ``route_filler``. None without
    routes."""


def shift_rows(
    x: torch.Tensor, shifts: torch.Tensor, fill: torch.Tensor | float | int
) -> torch.Tensor:
    """out[b, s] = x[b, s + shifts[b]], ``fill`` where that index leaves [0, S).

    A positive shift moves a row left (batch -> contiguous), a negative one back.
    """
    batch, seq = x.shape[:2]
    source = torch.arange(seq)[None, :] + shifts[:, None]
    inside = (source >= 0) & (source < seq)
    index = source.clamp(0, seq - 1)
    index = index.reshape(batch, seq, *([1] * (x.dim() - 2))).expand_as(x)
    moved = x.gather(1, index)
    fill_t = torch.as_tensor(fill, dtype=x.dtype).expand_as(moved)
    keep = inside.reshape(batch, seq, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.where(keep, moved, fill_t)


def route_filler_tensor(routes: torch.Tensor) -> torch.Tensor:
    """``route_filler`` for ``[..., K]`` routes, in their dtype: the fill of their padding rows."""
    return torch.from_numpy(route_filler(routes.shape[-1], np.int64)).to(routes.dtype)


def make_contiguous(batch: TrainingBatch, *, pad_token_id: int = 0) -> ContiguousBatch:
    seq = batch.sequences.shape[1]
    prompt_width = seq - batch.num_actions
    prompt_mask = batch.attention_mask[:, :prompt_width].to(torch.bool)
    shifts = (~prompt_mask).sum(dim=1).to(torch.int64)
    prompt_lens = prompt_width - shifts
    # Left padding must be one block: anything else would need a per-token gather.
    expected = torch.arange(prompt_width)[None, :] >= shifts[:, None]
    if not torch.equal(prompt_mask, expected):
        row = int((prompt_mask != expected).any(dim=1).nonzero()[0])
        raise ValueError(
            f"attention_mask[{row}, :{prompt_width}]: expected left padding then prompt "
            f"tokens, got {batch.attention_mask[row, :prompt_width].tolist()}"
        )
    if (prompt_lens < 1).any():
        row = int((prompt_lens < 1).nonzero()[0])
        raise ValueError(f"sequences[{row}]: expected at least one prompt token, got none")
    real = shift_rows(batch.attention_mask.to(torch.bool), shifts, False)
    tokens = shift_rows(batch.sequences.to(torch.int64), shifts, pad_token_id)
    tokens = tokens.masked_fill(~real, pad_token_id)
    padding = ~real
    routes = None
    if batch.routed_experts is not None:
        filler = route_filler_tensor(batch.routed_experts)
        routes = shift_rows(batch.routed_experts, shifts, filler)
        if batch.router_padding_mask is not None:
            padding = padding | shift_rows(batch.router_padding_mask.to(torch.bool), shifts, True)
    return ContiguousBatch(
        tokens=tokens, shifts=shifts, prompt_lens=prompt_lens, padding_mask=padding, routes=routes
    )


def pad_rows(layout: ContiguousBatch, rows: int, *, pad_token_id: int) -> ContiguousBatch:
    """``layout`` with filler rows appended up to ``rows``: pad tokens, all padding for
    the routers, filler routes. Pipeline stages exchange one activation shape per
    schedule, and the allgather dispatcher refuses variable shapes; a filler row's
    logits are dropped before any loss."""
    extra = rows - layout.tokens.shape[0]
    if extra < 0:
        raise ValueError(f"rows: expected at least {layout.tokens.shape[0]}, got {rows}")
    if extra == 0:
        return layout
    seq = layout.tokens.shape[1]
    routes = layout.routes
    if routes is not None:
        filler = route_filler_tensor(routes).expand(extra, seq, *routes.shape[2:])
        routes = torch.cat([routes, filler])
    return ContiguousBatch(
        tokens=torch.cat([layout.tokens, torch.full((extra, seq), pad_token_id)]),
        shifts=torch.cat([layout.shifts, torch.zeros(extra, dtype=torch.int64)]),
        prompt_lens=torch.cat([layout.prompt_lens, torch.ones(extra, dtype=torch.int64)]),
        padding_mask=torch.cat([layout.padding_mask, torch.ones(extra, seq, dtype=torch.bool)]),
        routes=routes,
    )


def pad_columns(layout: ContiguousBatch, multiple: int, *, pad_token_id: int) -> ContiguousBatch:
    """``layout`` with filler positions appended on the right up to a width divisible by
    ``multiple``: pad tokens, padding for the routers, filler routes. Every real token
    keeps its position, and causal attention keeps them from seeing the filler."""
    rows, seq = layout.tokens.shape
    extra = -seq % multiple
    if extra == 0:
        return layout
    routes = layout.routes
    if routes is not None:
        filler = route_filler_tensor(routes).expand(rows, extra, *routes.shape[2:])
        routes = torch.cat([routes, filler], dim=1)
    return dataclasses.replace(
        layout,
        tokens=torch.cat([layout.tokens, torch.full((rows, extra), pad_token_id)], dim=1),
        padding_mask=torch.cat([layout.padding_mask, torch.ones(rows, extra, dtype=torch.bool)], 1),
        routes=routes,
    )


def filler_rows(like: ContiguousBatch, rows: int, *, pad_token_id: int) -> ContiguousBatch:
    """``rows`` filler rows shaped like ``like``'s (its width, its route shape): a padding
    microbatch, for a schedule that needs more microbatches than there are."""
    empty = ContiguousBatch(
        tokens=like.tokens[:0],
        shifts=like.shifts[:0],
        prompt_lens=like.prompt_lens[:0],
        padding_mask=like.padding_mask[:0],
        routes=None if like.routes is None else like.routes[:0],
    )
    return pad_rows(empty, rows, pad_token_id=pad_token_id)


def response_logprobs(
    logits: torch.Tensor,
    layout: ContiguousBatch,
    response_mask: torch.Tensor,
    *,
    sampler: SamplerReplay | None = None,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """[B, R] fp32 logprob of each response token (0 where ``response_mask`` is 0),
    under ``sampler``'s distribution (None: the raw logits'). ``logits`` may be this
    rank's vocabulary shard (``VocabShard``): the result is then the whole vocabulary's.
    ``shard``: the part of the vocabulary ``logits`` cover (None: this rank's tensor
    parallel shard, ``VocabShard.of``)."""
    log_probs, targets, shard = _response_log_softmax(logits, layout, response_mask, sampler, shard)
    logprobs = shard.pick(log_probs, targets)
    return logprobs * response_mask.to(logprobs.device, logprobs.dtype)


def response_logprobs_and_entropy(
    logits: torch.Tensor,
    layout: ContiguousBatch,
    response_mask: torch.Tensor,
    *,
    sampler: SamplerReplay | None = None,
    shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``response_logprobs`` and, from the same log-softmax, the [B, R] fp32 entropy of
    the next-token distribution at each response position (0 where masked): the full
    vocabulary's, or the sampler's kept set's under ``sampler``."""
    log_probs, targets, shard = _response_log_softmax(logits, layout, response_mask, sampler, shard)
    mask = response_mask.to(log_probs.device, log_probs.dtype)
    logprobs = shard.pick(log_probs, targets) * mask
    return logprobs, shard.sum(token_entropy(log_probs)) * mask


@dataclass(frozen=True)
class VocabShard:
    """The part of the vocabulary this rank's logits cover: ids ``[start, start + size)``
    of ``vocab``. Megatron's output layer is column-parallel, so under tensor
    parallelism each rank's logits are one contiguous shard of the vocabulary; the
    log-softmax then runs across shards as megatron-core's vocab-parallel
    cross-entropy does (max and sum-exp all-reduced over the TP group), and nothing
    gathers the whole vocabulary's logits.

    The boundary with ``algorithms/sampler_replay.py``: the sampler's temperature and
    kept set (``sampler_logits`` with ``vocab_start=start``) and the entropy formula
    (``token_entropy``, its per-shard sums added up by ``sum``) are the backend-neutral
    ones; what is here is only what a split vocabulary adds, the all-reduced
    normaliser with its backward and the pick of a target from its owner shard. With
    one shard (``whole``) every step is the algorithms' own."""

    start: int
    size: int
    vocab: int
    group: Any = None

    @classmethod
    def of(cls, local_vocab: int) -> VocabShard:
        """This rank's shard, for logits ``[..., local_vocab]``."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return cls(start=0, size=local_vocab, vocab=local_vocab)
        ranks = parallel_state.get_tensor_model_parallel_world_size()
        if ranks == 1:
            return cls(start=0, size=local_vocab, vocab=local_vocab)
        rank = parallel_state.get_tensor_model_parallel_rank()
        return cls(
            start=rank * local_vocab,
            size=local_vocab,
            vocab=ranks * local_vocab,
            group=parallel_state.get_tensor_model_parallel_group(),
        )

    @property
    def whole(self) -> bool:
        return self.group is None

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every shard's ``partial`` (the same tensor on each rank). The gradient
        passes through unchanged, as in megatron-core's
        ``reduce_from_tensor_model_parallel_region``: each rank's loss is the same
        function of the sum, so d(loss)/d(own part) = d(loss)/d(sum)."""
        if self.whole:
            return partial
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(partial.contiguous(), group=self.group)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """This shard's part of the whole vocabulary's log-softmax over the last dim."""
        if self.whole:
            return torch.log_softmax(logits, dim=-1)
        return _VocabParallelLogSoftmax.apply(logits, self.group)

    def pick(self, log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``log_probs[..., targets]`` with global target ids, from whichever shard holds
        each (its owner contributes it, the others 0)."""
        if self.whole:
            return pick_targets(log_probs, targets)
        local = targets - self.start
        mine = (local >= 0) & (local < self.size)
        got = log_probs.gather(-1, local.clamp(0, self.size - 1)[..., None]).squeeze(-1)
        return self.sum(torch.where(mine, got, torch.zeros_like(got)))


class _VocabParallelLogSoftmax(torch.autograd.Function):
    """Log-softmax over a vocabulary split across the ranks of ``group``, each rank
    holding one shard of the last dim. The backward is written out (as in megatron-core's
    vocab-parallel cross-entropy) because the consumers of each shard's log-probs are
    local: autograd through all-reduces would give each rank only its own shard's part
    of d(loss)/d(log-normaliser) (measured: logit gradients off by up to 0.73 on a
    two-shard check). d logp_j / d x_i = [i == j] - p_i, so
    grad_x = g - p * (sum of g over the whole vocabulary)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, group: Any) -> torch.Tensor:
        peak = logits.max(dim=-1, keepdim=True).values
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - peak
        total = shifted.exp().sum(dim=-1, keepdim=True)
        torch.distributed.all_reduce(total, group=group)
        log_probs = shifted - total.log()
        ctx.save_for_backward(log_probs)
        ctx.group = group
        return log_probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (log_probs,) = ctx.saved_tensors
        total = grad.sum(dim=-1, keepdim=True)
        torch.distributed.all_reduce(total, group=ctx.group)
        return grad - log_probs.exp() * total, None


def _response_log_softmax(
    logits: torch.Tensor,
    layout: ContiguousBatch,
    response_mask: torch.Tensor,
    sampler: SamplerReplay | None,
    shard: VocabShard | None,
) -> tuple[torch.Tensor, torch.Tensor, VocabShard]:
    """[B, R, V_local] fp32 log-softmax (this rank's vocabulary shard of it) of the
    logits that predict each response token, under ``sampler``
    (``algorithms.sampler_replay.sampler_logits`` on this shard's ids), the [B, R]
    global target ids, and the shard."""
    num_actions = response_mask.shape[1]
    seq = layout.tokens.shape[1]
    if shard is None:
        shard = VocabShard.of(logits.shape[-1])
    target_pos = (layout.prompt_lens[:, None] + torch.arange(num_actions)[None, :]).clamp(
        max=seq - 1
    )
    source_pos = target_pos - 1
    picked = logits.gather(
        1, source_pos[:, :, None].expand(-1, -1, logits.shape[-1]).to(logits.device)
    ).float()
    targets = layout.tokens.gather(1, target_pos).to(logits.device)
    return (
        shard.log_softmax(sampler_logits(picked, sampler, vocab_start=shard.start)),
        targets,
        shard,
    )
