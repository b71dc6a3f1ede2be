"""The served-weights check on its own: fake engines answer the probe, a fake trainer
scores it. The real thing (builtin and vLLM engines, the MoE reload bug) runs in
tests/skyrl_train/entrypoints/test_main_base_served_weights.py and test_main_base_vllm.py.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from inference.client import GenerateResult, VersionSpan
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.errors import ServedWeightsError, SkyRLTrainError
from skyrl_train.trainer.served_weights import (
    PROBE_TOKENS,
    check_metrics,
    check_served_weights,
    is_due,
)

PROMPT = [5, 6, 7]
TRAINER = [-1.0, -2.0, -0.5, -3.0, -0.25]
"""The trainer's logprob of each probe token, the same for every engine's row."""


class Engine:
    """Answers the probe with fixed tokens and logprobs; records what it was sent."""

    def __init__(self, logprobs: list[float] | None, **result: Any) -> None:
        self.logprobs = logprobs
        self.result = result
        self.requests: list[dict[str, Any]] = []

    async def generate(self, **request: Any) -> GenerateResult:
        self.requests.append(request)
        return GenerateResult(
            response_ids=list(range(100, 100 + len(TRAINER))),
            finish_reason="length",
            logprobs=self.logprobs,
            **{"policy_version": 3, **self.result},
        )


def score_with(values: list[float], seen: list[TrainingBatch]) -> Any:
    async def score(batch: TrainingBatch) -> torch.Tensor:
        seen.append(batch)
        rows = batch.batch_size
        out = torch.zeros(rows, batch.loss_mask.shape[1])
        out[:, : len(values)] = torch.tensor(values)
        return out

    return score


def run(engines: list[Engine], *, tolerance: float = 0.1, version: int = 3) -> Any:
    seen: list[TrainingBatch] = []
    urls = [f"http://engine{i}" for i in range(len(engines))]
    checks = asyncio.run(
        check_served_weights(
            engines,
            urls,
            score_with(TRAINER, seen),
            prompt_ids=PROMPT,
            pad_token_id=0,
            policy_version=version,
            tolerance=tolerance,
        )
    )
    return checks, seen


def shifted(*deltas: float) -> list[float]:
    return [t + d for t, d in zip(TRAINER, deltas, strict=True)]


def test_engines_serving_the_trainers_weights_pass_and_are_measured() -> None:
    near = Engine(shifted(0.01, -0.02, 0.0, 0.03, 0.01))
    # One near-tie token far off: the median stays small, so the check passes.
    tie = Engine(shifted(0.0, 1.9, 0.02, 0.01, 0.0))
    checks, seen = run([near, tie])
    for engine in (near, tie):
        (request,) = engine.requests
        assert request["prompt_token_ids"] == PROMPT
        params = request["sampling_params"]
        assert params["temperature"] == 0.0 and params["max_tokens"] == PROBE_TOKENS
    # One forward for both engines: prompt + each engine's own served tokens.
    (batch,) = seen
    assert batch.batch_size == 2
    assert batch.loss_mask.sum().item() == 2 * len(TRAINER)
    assert checks[0].url == "http://engine0" and checks[1].url == "http://engine1"
    assert checks[0].median_abs_logp_diff == pytest.approx(0.01)
    assert checks[1].median_abs_logp_diff == pytest.approx(0.01)
    assert checks[1].worst_position == 1 and checks[1].worst_token_id == 101
    assert checks[1].worst_abs_logp_diff == pytest.approx(1.9)
    metrics = check_metrics(checks)
    assert metrics["served_weights/max_abs_logp_diff"] == pytest.approx(1.9)
    assert metrics["served_weights/mean_abs_logp_diff"] == pytest.approx(1.93 / 5)
    assert metrics["served_weights/median_abs_logp_diff"] == pytest.approx(0.01)


def test_an_engine_with_other_weights_stops_the_run_naming_it_and_its_worst_token() -> None:
    good = Engine(shifted(0.0, 0.0, 0.0, 0.0, 0.0))
    wrong = Engine(shifted(0.5, -1.5, 0.4, 4.75, -0.3))
    with pytest.raises(ServedWeightsError) as info:
        run([good, wrong])
    err = info.value
    assert isinstance(err, SkyRLTrainError) and isinstance(err, ValueError)
    assert err.url == "http://engine1" and err.policy_version == 3
    assert err.check.worst_position == 3 and err.check.worst_token_id == 103
    text = str(err)
    assert text.startswith("engine http://engine1 after the push of policy version 3: ")
    assert "generator.inference_engine.verify_weights_tolerance" in text
    assert "median |served - trainer| logprob <= 0.1 over the probe's 5 greedy tokens" in text
    assert "got 0.5 (mean 1.49)" in text
    assert "worst: token 3 (id 103), served 1.7500, trainer -3.0000" in text


def test_the_bound_is_on_the_median() -> None:
    engine = Engine(shifted(0.2, 0.2, 0.2, 0.0, 0.0))
    run([engine], tolerance=0.2)  # median 0.2: within
    with pytest.raises(ServedWeightsError, match="got 0.2 "):
        run([Engine(shifted(0.2, 0.2, 0.2, 0.0, 0.0))], tolerance=0.19)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_served_logprob_fails(bad: float) -> None:
    with pytest.raises(ServedWeightsError, match="verify_weights_tolerance"):
        run([Engine(shifted(0.0, 0.0, bad, 0.0, 0.0))])


def test_a_placeholder_logprob_fails() -> None:
    # -9999: the engine could not compute the logprob; its weights are not usable.
    logprobs = shifted(0.0, 0.0, 0.0, 0.0, 0.0)
    logprobs[:3] = [-9999.0] * 3
    with pytest.raises(ServedWeightsError, match="served -9999.0000"):
        run([Engine(logprobs)])


def test_an_engine_on_another_policy_version_fails() -> None:
    with pytest.raises(ServedWeightsError, match=r"got version\(s\) \[2\]"):
        run([Engine(TRAINER, policy_version=2)])
    spans = [VersionSpan(2, 0, 2), VersionSpan(3, 2, 5)]
    with pytest.raises(ServedWeightsError, match=r"got version\(s\) \[2, 3\]"):
        run([Engine(TRAINER, policy_version=2, policy_version_spans=spans)])
    # A server that reports no version is checked on its logprobs alone.
    run([Engine(TRAINER, policy_version=None)])


def test_an_engine_without_logprobs_fails() -> None:
    with pytest.raises(ServedWeightsError, match="expected logprobs of the probe's tokens"):
        run([Engine(None)])


@pytest.mark.parametrize(
    ("step", "interval", "start", "due"),
    [
        (0, 10, 0, True),  # the launch's push
        (1, 10, 0, False),
        (10, 10, 0, True),
        (7, 10, 7, True),  # a resumed run checks its launch push too
        (20, 10, 7, True),
        (3, 1, 0, True),
        (0, 0, 0, False),  # 0: never
        (10, 0, 0, False),
    ],
)
def test_when_a_check_is_due(step: int, interval: int, start: int, due: bool) -> None:
    assert is_due(step, interval=interval, start_step=start) is due
