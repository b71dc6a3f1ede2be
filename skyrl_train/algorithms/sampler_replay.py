"""Scoring tokens under the rollout sampler's distribution (sampler replay), and its
entropy, on plain logits.

The engine samples from softmax(logits / T) over a kept set (its top-k and top-p cuts,
``inference/engine/sampling.py``); the rollout reports that set and the trainer scores
every token under the same distribution, the set replayed rather than recomputed, as
routes are (docs/design.md §6: under the trainer's weights the top-p prefix would move).

The functions here take logits ``[..., V]`` (one row per scored token) and a support
``[..., k]`` of the same leading shape, so any backend that holds the whole
vocabulary's logits calls them as they are. A backend whose logits are split over the
vocabulary (Megatron's column-parallel output layer:
``workers/megatron/layout.VocabShard``) keeps its own log-normaliser, all-reduced
over its shards, and calls ``sampler_logits`` with its shard's first id, so the
kept-set rule and the temperature exist once, and ``token_entropy``, whose sum over
the vocabulary it adds up over the shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_train.algorithms.signals import token_entropy


@dataclass(frozen=True)
class SamplerReplay:
    """The rollout sampler's distribution, replayed on the trainer's logits: softmax of
    ``logits / temperature`` over each position's kept set (``support``), renormalised.
    This is the engine's behaviour policy (``inference/engine/sampling.py``), with the
    kept set taken from the rollout rather than recomputed, as routes are."""

    temperature: float = 1.0
    support: torch.Tensor | None = None
    """[..., k] token ids the rollout's sampler kept at each scored position (a batch's
    ``sample_support`` is [B, R, k]), -1 past the set; a row with no id (prompt
    padding, observation tokens) keeps every token. None: no top-k or top-p cut, the
    whole vocabulary."""


def kept_set(support: torch.Tensor, *, vocab_size: int, vocab_start: int = 0) -> torch.Tensor:
    """[..., vocab_size] bool over the ids ``[vocab_start, vocab_start + vocab_size)``:
    the ids each row of ``support`` [..., k] lists (ids outside that window are left
    to the shard that holds them), or every id where the row lists none."""
    ids = support.to(torch.int64)
    listed = ids >= 0
    local = ids - vocab_start
    # -1 entries and ids outside the window land in an extra column that is dropped,
    # so they cannot clear a real id.
    index = torch.where(listed & (local >= 0) & (local < vocab_size), local, vocab_size)
    kept = torch.zeros(*ids.shape[:-1], vocab_size + 1, dtype=torch.bool, device=ids.device)
    kept.scatter_(-1, index, True)
    return kept[..., :vocab_size] | ~listed.any(dim=-1, keepdim=True)


def sampler_logits(
    logits: torch.Tensor, sampler: SamplerReplay | None, *, vocab_start: int = 0
) -> torch.Tensor:
    """``logits`` [..., V] in fp32 as the sampler's softmax takes them: divided by its
    temperature and -inf outside its kept set (None: the raw logits). ``vocab_start``:
    the first id the last dim covers, for a shard of the vocabulary."""
    scaled = logits.float()
    if sampler is None:
        return scaled
    if sampler.temperature != 1.0:
        scaled = scaled / sampler.temperature
    if sampler.support is not None:
        kept = kept_set(
            sampler.support.to(scaled.device),
            vocab_size=scaled.shape[-1],
            vocab_start=vocab_start,
        )
        scaled = scaled.masked_fill(~kept, float("-inf"))
    return scaled


def pick_targets(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_probs[..., targets]``: each row's log-prob of its own target id."""
    return log_probs.gather(-1, targets[..., None]).squeeze(-1)


def sampler_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, *, sampler: SamplerReplay | None = None
) -> torch.Tensor:
    """[...] fp32 log-prob of each ``targets`` id under ``sampler``'s distribution on
    ``logits`` [..., V] (None: the raw logits' softmax). A target outside its kept set
    scores -inf: the sampler could not have drawn it."""
    return pick_targets(torch.log_softmax(sampler_logits(logits, sampler), dim=-1), targets)


def sampler_log_probs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, sampler: SamplerReplay | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampler_log_probs`` and, from the same log-softmax, the [...] fp32 entropy in
    nats of each row's distribution: the whole vocabulary's, or the kept set's under
    ``sampler``."""
    log_probs = torch.log_softmax(sampler_logits(logits, sampler), dim=-1)
    return pick_targets(log_probs, targets), token_entropy(log_probs)
