"""Re-lay a TrainingBatch out for Megatron and map results back.

Megatron's GPTModel ignores ``position_ids`` for RoPE (always 0..S-1), so a
left-padded prompt would put every real token at the wrong rotary position. Each row
is shifted left by its prompt padding so it is contiguous from position 0 (right
padded), and its routes move with it. Response token j of row b then sits at position
``prompt_len[b] + j``; its logprob comes from the logits one position earlier.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference.wire import route_filler
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
) -> torch.Tensor:
    """[B, R] fp32 logprob of each response token (0 where ``response_mask`` is 0),
    under ``sampler``'s distribution (None: the raw logits')."""
    log_probs, targets = _response_log_softmax(logits, layout, response_mask, sampler)
    logprobs = log_probs.gather(2, targets[:, :, None]).squeeze(2)
    return logprobs * response_mask.to(logprobs.device, logprobs.dtype)


def response_logprobs_and_entropy(
    logits: torch.Tensor,
    layout: ContiguousBatch,
    response_mask: torch.Tensor,
    *,
    sampler: SamplerReplay | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``response_logprobs`` and, from the same log-softmax, the [B, R] fp32 entropy of
    the next-token distribution at each response position (0 where masked): the full
    vocabulary's, or the sampler's kept set's under ``sampler``."""
    log_probs, targets = _response_log_softmax(logits, layout, response_mask, sampler)
    mask = response_mask.to(log_probs.device, log_probs.dtype)
    logprobs = log_probs.gather(2, targets[:, :, None]).squeeze(2) * mask
    return logprobs, token_entropy(log_probs) * mask


@dataclass(frozen=True)
class SamplerReplay:
    """The rollout sampler's distribution, replayed on the trainer's logits: softmax of
    ``logits / temperature`` over each position's kept set (``support``), renormalised.
    This is the engine's behaviour policy (``inference/engine/sampling.py``), with the
    kept set taken from the rollout rather than recomputed, as routes are."""

    temperature: float = 1.0
    support: torch.Tensor | None = None
    """[B, R, k] token ids the rollout's sampler kept at each response position, -1 past
    the set; a row with no id (prompt padding, observation tokens) keeps every token.
    None: no top-k or top-p cut, the whole vocabulary."""


def _response_log_softmax(
    logits: torch.Tensor,
    layout: ContiguousBatch,
    response_mask: torch.Tensor,
    sampler: SamplerReplay | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R, V] fp32 log-softmax of the logits that predict each response token, and
    the [B, R] target ids."""
    num_actions = response_mask.shape[1]
    seq = layout.tokens.shape[1]
    target_pos = (layout.prompt_lens[:, None] + torch.arange(num_actions)[None, :]).clamp(
        max=seq - 1
    )
    source_pos = target_pos - 1
    picked = logits.gather(
        1, source_pos[:, :, None].expand(-1, -1, logits.shape[-1]).to(logits.device)
    ).float()
    targets = layout.tokens.gather(1, target_pos).to(logits.device)
    if sampler is not None:
        if sampler.temperature != 1.0:
            picked = picked / sampler.temperature
        if sampler.support is not None:
            kept = _kept(sampler.support.to(picked.device), picked.shape[-1])
            picked = picked.masked_fill(~kept, float("-inf"))
    return torch.log_softmax(picked, dim=-1), targets


def _kept(support: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, R, V] bool: the listed ids of each row, or every id where none is listed."""
    ids = support.to(torch.int64)
    listed = ids >= 0
    # -1 entries land in an extra column that is dropped, so they cannot clear a real id.
    index = torch.where(listed, ids, vocab)
    kept = torch.zeros(*ids.shape[:2], vocab + 1, dtype=torch.bool, device=ids.device)
    kept.scatter_(2, index, True)
    return kept[..., :vocab] | ~listed.any(dim=-1, keepdim=True)
