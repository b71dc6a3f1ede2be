"""Batched sampling with one random stream per request, and the behaviour policy.

**The behaviour policy** (what "processed" logprobs are, here and in the trainer): a
request with temperature T, top-k k and top-p p draws its next token from

    q = softmax(z / T) restricted to the kept set, renormalised over it,

where z are the model's float32 logits. The kept set is built on the tokens sorted by
z / T, most likely first (a stable sort: equal values keep id order):

1. top-k: the first k of them (all for k = -1; exactly k, ties at the k-th value
   broken by id, where vLLM keeps every tied token);
2. top-p: of those, the shortest prefix whose mass under softmax(z / T) renormalised
   over step 1's set reaches p, i.e. a token is kept when the mass before it is < p;
   the first token always is, and p = 1 keeps every one of them (no cut).

Greedy (T = 0) is the one-token limit: q = 1 on the argmax (logprob 0).
``logprobs_mode="processed_logprobs"`` reports log q of the sampled token and of each
listed support candidate; ``"raw_logprobs"`` (the default, as in vLLM) reports
log softmax(z) for both, the same numbers at T = 1 without a cut. The support side
channel lists the kept set's first k ids in that order (-1 past the set) and its size
(above k: the list is cut short). ``kept_set`` is the one definition of q, which the
sampler draws from; ``processed_logprobs`` returns it in vocabulary order, a reference
for code that must agree with the sampler (the trainer's tests).

Every request owns a ``torch.Generator`` and draws exactly one uniform per step from
it, so a request's tokens depend on its seed and logits only, never on which other
requests shared the batch. The distribution processing (temperature, top-k, top-p)
is vectorised over the batch: a per-request Python loop cost ~3 ms per step at
batch 64, a fifth of the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference.engine.base import PROCESSED_LOGPROBS, SamplingParams

__all__ = ["BatchSampler", "KeptSet", "StepSample", "kept_set", "processed_logprobs"]


@dataclass
class StepSample:
    tokens: torch.Tensor
    """[B] int64 sampled token ids."""
    logprobs: torch.Tensor
    """[B] float32 logprob of each sampled token, in its request's ``logprobs_mode``."""
    support_ids: torch.Tensor | None
    """[B, k] int32 kept-set ids (highest probability first), -1 past the kept set."""
    support_logprobs: torch.Tensor | None
    """[B, k] float32 logprobs of those candidates (``logprobs_mode``), -inf past the set."""
    support_size: torch.Tensor | None
    """[B] int32 size of each kept set; larger than k when the listed ids are cut short."""


@dataclass
class KeptSet:
    """The behaviour policy of a batch of rows, in each row's descending order."""

    sorted_ids: torch.Tensor
    """[B, V] int64 token ids, most likely first (stable: ties keep id order)."""
    probs: torch.Tensor
    """[B, V] float32 unnormalised q in sorted order, 0 outside the kept set."""
    logq: torch.Tensor
    """[B, V] float32 log q in sorted order (normalised), -inf outside the kept set."""
    size: torch.Tensor
    """[B] int64 kept-set sizes (>= 1); the set is ``sorted_ids[:, :size]``."""


def kept_set(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
) -> KeptSet:
    """q for every row of float32 ``logits`` ``[B, V]``; per-row ``temperature`` (> 0,
    ignored where ``greedy``), ``top_k`` (-1: none), ``top_p`` and ``greedy``."""
    batch, vocab = logits.shape
    scaled = logits / temperature[:, None]
    sorted_vals, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    k = torch.where(greedy, 1, k)
    keep = rank < k[:, None]
    sorted_vals = sorted_vals.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_vals, dim=-1)
    # top-p keeps the shortest prefix whose mass reaches top_p (always >= 1 token).
    # top_p = 1 is no cut, exactly: the float32 running sum reaches 1 before the tail
    # (of 152,064 logits drawn N(0, 3^2) it kept 128k-130k, dropping ~2.8e-5 of the
    # mass), while the trainer replays the whole vocabulary for it (docs/design.md §7).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep[:, 0] = True
    probs = probs.masked_fill(~keep, 0.0)
    logq = torch.log_softmax(sorted_vals.masked_fill(~keep, float("-inf")), dim=-1)
    return KeptSet(sorted_ids=sorted_ids, probs=probs, logq=logq, size=keep.sum(dim=-1))


def processed_logprobs(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor,
    top_k: int | torch.Tensor = -1,
    top_p: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log q of every token of ``logits`` ``[B, V]`` in vocabulary order (-inf outside
    the kept set) and the ``[B, V]`` bool kept set; each parameter is one value or one
    per row, and temperature 0 is greedy. Computed in float32 through ``kept_set``, as
    the sampler computes it, so a caller's numbers are the engine's to the bit."""
    logits = logits.float()
    batch = logits.shape[0]

    def per_row(value: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(value, dtype=dtype, device=logits.device).expand(batch).clone()

    temp = per_row(temperature, torch.float32)
    greedy = temp == 0
    q = kept_set(
        logits,
        temperature=temp.masked_fill(greedy, 1.0),  # greedy ignores it; avoid z / 0
        top_k=per_row(top_k, torch.int64),
        top_p=per_row(top_p, torch.float32),
        greedy=greedy,
    )
    logq = torch.empty_like(q.logq).scatter_(1, q.sorted_ids, q.logq)
    in_set = torch.arange(logits.shape[1], device=logits.device)[None, :] < q.size[:, None]
    keep = torch.empty_like(in_set).scatter_(1, q.sorted_ids, in_set)
    return logq, keep


class BatchSampler:
    """Samples the next token of ``len(params)`` requests from ``[B, V]`` logits."""

    def __init__(
        self,
        params: Sequence[SamplingParams],
        *,
        generators: Sequence[torch.Generator],
        support_k: int,
    ) -> None:
        self.params = list(params)
        self.generators = list(generators)
        self.support_k = support_k
        self._temperature = torch.tensor(
            [p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32
        )
        self._greedy = torch.tensor([p.temperature == 0 for p in params])
        self._top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        self._top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        self._processed = torch.tensor([p.logprobs_mode == PROCESSED_LOGPROBS for p in params])

    def select(self, rows: torch.Tensor) -> None:
        """Keeps only the requests at ``rows`` (finished ones leave the batch)."""
        keep = rows.tolist()
        self.params = [self.params[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]
        self._temperature = self._temperature[rows]
        self._greedy = self._greedy[rows]
        self._top_k = self._top_k[rows]
        self._top_p = self._top_p[rows]
        self._processed = self._processed[rows]

    def sample(self, logits: torch.Tensor) -> StepSample:
        logits = logits.float()
        vocab = logits.shape[1]
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        q = kept_set(
            logits,
            temperature=self._temperature,
            top_k=self._top_k,
            top_p=self._top_p,
            greedy=self._greedy,
        )
        cdf = torch.cumsum(q.probs, dim=-1)
        uniforms = torch.cat([torch.rand(1, generator=g) for g in self.generators])
        pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)
        # The kept set is a prefix of the sorted order, so clamping to its length
        # guards the float edge where u * total lands exactly on the last cdf value.
        pick = torch.minimum(pick[:, 0], q.size - 1)
        pick = torch.where(self._greedy, 0, pick)
        tokens = q.sorted_ids.gather(1, pick[:, None])[:, 0]
        processed = self._processed
        logprobs = torch.where(
            processed,
            q.logq.gather(1, pick[:, None])[:, 0],
            raw_logprobs.gather(1, tokens[:, None])[:, 0],
        )
        support_ids = support_logprobs = support_size = None
        if self.support_k > 0:
            k = min(self.support_k, vocab)
            ids = q.sorted_ids[:, :k]
            inside = torch.arange(k)[None, :] < q.size[:, None]
            values = torch.where(processed[:, None], q.logq[:, :k], raw_logprobs.gather(1, ids))
            support_logprobs = values.masked_fill(~inside, float("-inf"))
            support_ids = ids.masked_fill(~inside, -1).to(torch.int32)
            support_size = q.size.to(torch.int32)
            if k < self.support_k:
                pad = self.support_k - k
                support_ids = torch.nn.functional.pad(support_ids, (0, pad), value=-1)
                support_logprobs = torch.nn.functional.pad(
                    support_logprobs, (0, pad), value=float("-inf")
                )
        return StepSample(tokens, logprobs, support_ids, support_logprobs, support_size)
