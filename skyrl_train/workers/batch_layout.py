"""Re-lay a TrainingBatch out for a trainer model and score its responses: every backend's.

A left-padded prompt would put every real token at the wrong rotary position in a
model that counts positions from 0 (Megatron's GPTModel ignores ``position_ids``; the
FSDP backend feeds 0..S-1 with a plain causal mask). Each row is shifted left by its
prompt padding so it is contiguous from position 0 (right padded), and its routes move
with it. Response token j of row b then sits at position ``prompt_len[b] + j``; its
logprob comes from the logits one position earlier. Causal attention keeps every real
token from seeing the right-hand padding.

The scoring runs on the whole vocabulary's logits, or on one shard of them through a
``VocabPart`` (Megatron's tensor-parallel ``workers/megatron/layout.VocabShard``); the
sampler's temperature, kept set and entropy are ``algorithms/sampler_replay.py``'s.
Nothing here imports a backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from skyrl_train.algorithms.sampler_replay import SamplerReplay, pick_targets, sampler_logits
from skyrl_train.algorithms.signals import token_entropy
from skyrl_train.dataset.batch import TrainingBatch, select_rows, slice_batch
from skyrl_train.dataset.route_rows import PackedRouteRows, route_filler_tensor
from skyrl_train.errors import RouteReplayError
from skyrl_train.workers.microbatches import MicrobatchPlan


def split_microbatches(
    batch: TrainingBatch, plan: int | MicrobatchPlan | None
) -> list[TrainingBatch]:
    """``batch`` cut into microbatches: ``plan``'s row groups (``workers/microbatches.py``),
    or for an int (None: one) consecutive slices of that many rows, the last one shorter
    when the rows do not divide; none splitting a row (the gradient contract of
    ``workers/base.py``). Per-row results go back to batch order with
    ``as_plan(...).in_batch_order``."""
    plan = as_plan(batch, plan)
    if plan.rows != batch.batch_size:
        raise ValueError(
            f"micro_batch_size: expected a plan of the batch's {batch.batch_size} rows, "
            f"got {plan.rows}"
        )
    if plan.is_consecutive:
        bounds = [0]
        for group in plan.groups:
            bounds.append(bounds[-1] + len(group))
        return [slice_batch(batch, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [select_rows(batch, torch.tensor(group)) for group in plan.groups]


def as_plan(batch: TrainingBatch, plan: int | MicrobatchPlan | None) -> MicrobatchPlan:
    """``plan`` itself, or ``MicrobatchPlan.by_rows`` of the batch for an int or None."""
    if isinstance(plan, MicrobatchPlan):
        return plan
    return MicrobatchPlan.by_rows(batch.batch_size, plan)


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

    def response_index(self, num_actions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, positions)``, each broadcastable to ``[B, R]``: where the logits that
        predict response token j of row b sit (``logits[rows, positions]``); the token
        itself is one position later. Positions past a row's end are clamped (masked)."""
        seq = self.tokens.shape[1]
        target = (self.prompt_lens[:, None] + torch.arange(num_actions)[None, :]).clamp(max=seq - 1)
        return torch.arange(self.tokens.shape[0])[:, None], target - 1

    def to_batch_layout(self, routes: torch.Tensor) -> torch.Tensor:
        """Routes ``[B, S, L, K]`` captured on these rows, moved back to the batch's
        layout (on the CPU); the left padding gets ``route_filler``."""
        routes = routes.cpu()
        return shift_rows(routes, -self.shifts, route_filler_tensor(routes))


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


def row_extents(batch: TrainingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(shifts, prompt_lens)`` ``[B]``: each row's left padding and real prompt tokens,
    the left padding checked to be one block and every row to hold a prompt token."""
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
    return shifts, prompt_lens


def aligned_route_rows(batch: TrainingBatch, shifts: torch.Tensor) -> PackedRouteRows:
    """The batch's packed routes, checked to cover each row's real tokens exactly (the
    row's left padding ``shifts`` and its token count): a batch whose routes were packed
    for other rows would replay every token with another token's experts."""
    routes = batch.routed_experts
    assert isinstance(routes, PackedRouteRows)
    lengths = batch.attention_mask.to(torch.int64).sum(dim=1)
    for name, got, want in (
        ("starts", routes.starts, shifts),
        ("lengths", routes.lengths, lengths),
    ):
        if got.shape != want.shape or not torch.equal(got.cpu(), want):
            bad = 0 if got.shape != want.shape else int((got.cpu() != want).nonzero()[0])
            raise RouteReplayError(
                f"routed_experts.{name}",
                expected=f"each row's real tokens in the batch layout ({want.tolist()[:8]})",
                got=str(got.tolist()[:8]) + f" (row {bad} differs)",
            )
    return routes


def make_contiguous(batch: TrainingBatch, *, pad_token_id: int = 0) -> ContiguousBatch:
    shifts, prompt_lens = row_extents(batch)
    real = shift_rows(batch.attention_mask.to(torch.bool), shifts, False)
    tokens = shift_rows(batch.sequences.to(torch.int64), shifts, pad_token_id)
    tokens = tokens.masked_fill(~real, pad_token_id)
    padding = ~real
    routes = None
    if isinstance(batch.routed_experts, PackedRouteRows):
        # Only this microbatch's rectangle is built, with rows already at column 0.
        routes = aligned_route_rows(batch, shifts).rectangle(contiguous=True)
    elif batch.routed_experts is not None:
        filler = route_filler_tensor(batch.routed_experts)
        routes = shift_rows(batch.routed_experts, shifts, filler)
    if batch.routed_experts is not None:
        if batch.router_padding_mask is not None:
            padding = padding | shift_rows(batch.router_padding_mask.to(torch.bool), shifts, True)
    return ContiguousBatch(
        tokens=tokens, shifts=shifts, prompt_lens=prompt_lens, padding_mask=padding, routes=routes
    )


class ScoredLayout(Protocol):
    """The rows a model ran, as scoring reads them: ``ContiguousBatch`` (one row per
    trajectory) or ``workers/packed_layout.PackedBatch`` (every trajectory in one row)."""

    @property
    def tokens(self) -> torch.Tensor:
        """``[rows, width]`` int64 token ids fed to the model."""
        ...

    def response_index(self, num_actions: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def to_batch_layout(self, routes: torch.Tensor) -> torch.Tensor: ...


class VocabPart(Protocol):
    """The part of the vocabulary a rank's logits cover (``WholeVocabulary``, or
    Megatron's tensor-parallel ``VocabShard``): its first id and the three steps of the
    scoring that a split vocabulary changes. ``log_softmax`` also gives padded ids
    (rows Megatron adds so TP divides the vocabulary) probability 0."""

    @property
    def start(self) -> int: ...

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor: ...

    def pick(self, log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def sum(self, partial: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class WholeVocabulary:
    """Logits over every id: the algorithms' own log-softmax, pick and sum."""

    start: int = 0

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1)

    def pick(self, log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return pick_targets(log_probs, targets)

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        return partial


def response_logprobs(
    logits: torch.Tensor,
    layout: ScoredLayout,
    response_mask: torch.Tensor,
    *,
    sampler: SamplerReplay | None = None,
    shard: VocabPart | None = None,
) -> torch.Tensor:
    """[B, R] fp32 logprob of each response token (0 where ``response_mask`` is 0),
    under ``sampler``'s distribution (None: the raw logits'). ``shard``: the part of
    the vocabulary ``logits`` cover (None: all of it); the result is the whole
    vocabulary's either way."""
    log_probs, targets, part = response_log_softmax(logits, layout, response_mask, sampler, shard)
    logprobs = part.pick(log_probs, targets)
    return logprobs * response_mask.to(logprobs.device, logprobs.dtype)


def response_logprobs_and_entropy(
    logits: torch.Tensor,
    layout: ScoredLayout,
    response_mask: torch.Tensor,
    *,
    sampler: SamplerReplay | None = None,
    shard: VocabPart | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``response_logprobs`` and, from the same log-softmax, the [B, R] fp32 entropy of
    the next-token distribution at each response position (0 where masked): the full
    vocabulary's, or the sampler's kept set's under ``sampler``."""
    log_probs, targets, part = response_log_softmax(logits, layout, response_mask, sampler, shard)
    mask = response_mask.to(log_probs.device, log_probs.dtype)
    logprobs = part.pick(log_probs, targets) * mask
    return logprobs, part.sum(token_entropy(log_probs)) * mask


def response_log_softmax(
    logits: torch.Tensor,
    layout: ScoredLayout,
    response_mask: torch.Tensor,
    sampler: SamplerReplay | None,
    shard: VocabPart | None,
) -> tuple[torch.Tensor, torch.Tensor, VocabPart]:
    """[B, R, V_local] fp32 log-softmax (``shard``'s part of it) of the logits that
    predict each response token, under ``sampler`` (``sampler_logits`` on the shard's
    ids), the [B, R] global target ids, and the part (``WholeVocabulary`` for None)."""
    part: VocabPart = shard if shard is not None else WholeVocabulary()
    rows, source = layout.response_index(response_mask.shape[1])
    picked = logits[rows.to(logits.device), source.to(logits.device)].float()
    targets = layout.tokens[rows, source + 1].to(logits.device)
    return (
        part.log_softmax(sampler_logits(picked, sampler, vocab_start=part.start)),
        targets,
        part,
    )


def score_responses(
    logits: torch.Tensor,
    layout: ScoredLayout,
    microbatch: TrainingBatch,
    *,
    entropy: bool,
    temperature: float,
    shard: VocabPart | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A microbatch's response logprobs ``[b, R]`` and, with ``entropy``, entropy,
    under the rollout sampler's distribution: softmax(logits / ``temperature``) over
    the batch's ``sample_support`` when it has one. What every backend's forward and
    train step score."""
    sampler = SamplerReplay(temperature=temperature, support=microbatch.sample_support)
    mask = microbatch.response_mask
    if entropy:
        return response_logprobs_and_entropy(logits, layout, mask, sampler=sampler, shard=shard)
    return response_logprobs(logits, layout, mask, sampler=sampler, shard=shard), None
