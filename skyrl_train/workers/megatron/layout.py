"""Megatron's side of the batch layout: the padding its schedules need, and the
vocabulary split over tensor-parallel ranks.

The contiguous re-layout and the response scoring are every backend's
(``workers/batch_layout.py``, re-exported here under their old names). What is here:
filler rows and columns (pipeline stages exchange one activation shape, sequence
parallelism splits the width evenly) and ``VocabShard``, the column-parallel output
layer's part of the vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from skyrl_train.algorithms.sampler_replay import SamplerReplay, pick_targets
from skyrl_train.workers import batch_layout
from skyrl_train.workers.batch_layout import (
    ContiguousBatch,
    make_contiguous,
    route_filler_tensor,
    shift_rows,
)

__all__ = [
    "ContiguousBatch",
    "SamplerReplay",
    "VocabShard",
    "filler_rows",
    "make_contiguous",
    "pad_columns",
    "pad_rows",
    "response_logprobs",
    "response_logprobs_and_entropy",
    "route_filler_tensor",
    "shift_rows",
]


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
    """``batch_layout.response_logprobs`` on this rank's tensor-parallel vocabulary
    shard when ``shard`` is None (``VocabShard.of``); the result is the whole
    vocabulary's."""
    return batch_layout.response_logprobs(
        logits,
        layout,
        response_mask,
        sampler=sampler,
        shard=shard or VocabShard.of(logits.shape[-1]),
    )


def response_logprobs_and_entropy(
    logits: torch.Tensor,
    layout: ContiguousBatch,
    response_mask: torch.Tensor,
    *,
    sampler: SamplerReplay | None = None,
    shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_layout.response_logprobs_and_entropy`` on this rank's tensor-parallel
    vocabulary shard when ``shard`` is None (``VocabShard.of``)."""
    return batch_layout.response_logprobs_and_entropy(
        logits,
        layout,
        response_mask,
        sampler=sampler,
        shard=shard or VocabShard.of(logits.shape[-1]),
    )


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
    one shard (``whole``) and no padding every step is the algorithms' own.

    A vocabulary the ranks do not divide is padded (``model.padded_vocab_size``): ids
    from ``real_vocab`` on are no token, and their logits are set to -inf before the
    log-softmax, so they add nothing to the normaliser, the entropy or the kept set's
    mass, and get no gradient."""

    start: int
    size: int
    vocab: int
    group: Any = None
    real_vocab: int | None = None
    """The checkpoint's vocabulary, when ``vocab`` pads it; None: no padding."""

    @classmethod
    def of(cls, local_vocab: int, *, real_vocab: int | None = None) -> VocabShard:
        """This rank's shard, for logits ``[..., local_vocab]``; ``real_vocab``: the
        checkpoint's vocabulary (None: the logits hold no padded ids)."""
        from megatron.core import parallel_state

        ranks, rank, group = 1, 0, None
        if parallel_state.model_parallel_is_initialized():
            ranks = parallel_state.get_tensor_model_parallel_world_size()
            rank = parallel_state.get_tensor_model_parallel_rank()
            if ranks > 1:
                group = parallel_state.get_tensor_model_parallel_group()
        vocab = ranks * local_vocab
        return cls(
            start=rank * local_vocab,
            size=local_vocab,
            vocab=vocab,
            group=group,
            real_vocab=real_vocab if real_vocab is not None and real_vocab < vocab else None,
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

    @property
    def padded(self) -> int:
        """Padded ids at the end of this shard (0 where all are tokens)."""
        if self.real_vocab is None:
            return 0
        return min(self.size, max(0, self.start + self.size - self.real_vocab))

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """This shard's part of the whole vocabulary's log-softmax over the last dim;
        padded ids get -inf (probability 0)."""
        if self.padded:
            logits = logits.clone()
            logits[..., self.size - self.padded :] = float("-inf")
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
