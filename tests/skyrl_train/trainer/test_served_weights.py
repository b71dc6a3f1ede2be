"""The served-weights check on its own: fake engines answer the probes, a fake trainer
scores them. A real engine and trainer (a top-2 Mixtral in bf16, replayed routes, a
push of other weights) run in tests/skyrl_train/trainer/test_served_weights_engines.py;
whole launches in tests/skyrl_train/entrypoints/test_main_base_served_weights.py and
test_main_base_vllm.py (vLLM's MoE reload bug).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
import torch

from inference.client import GenerateResult, VersionSpan
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.errors import ServedWeightsError, SkyRLTrainError
from skyrl_train.trainer.served_weights import (
    PROBE_PROMPTS,
    PROBE_ROWS_SCANNED,
    PROBE_TOKENS,
    check_metrics,
    check_served_weights,
    is_due,
    probe_prompts,
)

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
TRAINER = [-1.0, -2.0, -0.5, -3.0, -0.25]
"""The trainer's logprob of each probe token, the same for every probe and engine."""
LAYERS, TOPK = 2, 2


class Engine:
    """Answers probe ``p`` with fixed tokens and ``logprobs[p]`` (one list: every
    probe); records what it was sent. With routes requested it returns some."""

    def __init__(self, logprobs: list[Any] | None, **result: Any) -> None:
        self.logprobs = logprobs
        self.result = result
        self.requests: list[dict[str, Any]] = []

    async def generate(self, **request: Any) -> GenerateResult:
        self.requests.append(request)
        probe = PROMPTS.index(list(request["prompt_token_ids"]))
        logprobs = self.logprobs
        if logprobs is not None and isinstance(logprobs[0], list):
            logprobs = logprobs[probe]
        routes = None
        if request.get("return_routed_experts"):
            rows = len(request["prompt_token_ids"]) + len(TRAINER) - 1
            routes = np.zeros((rows, LAYERS, TOPK), dtype=np.uint8)
            routes[..., 1] = 1
        return GenerateResult(
            response_ids=list(range(100, 100 + len(TRAINER))),
            finish_reason="length",
            logprobs=logprobs,
            **{"policy_version": 3, "routed_experts": routes, **self.result},
        )


def score_with(values: list[float], seen: list[TrainingBatch]) -> Any:
    async def score(batch: TrainingBatch) -> torch.Tensor:
        seen.append(batch)
        out = torch.zeros(batch.batch_size, batch.loss_mask.shape[1])
        out[:, : len(values)] = torch.tensor(values)
        return out

    return score


def run(
    engines: list[Engine], *, tolerance: float = 0.1, version: int = 3, routes: bool = False
) -> Any:
    seen: list[TrainingBatch] = []
    urls = [f"http://engine{i}" for i in range(len(engines))]
    checks = asyncio.run(
        check_served_weights(
            engines,
            urls,
            score_with(TRAINER, seen),
            prompts=PROMPTS,
            pad_token_id=0,
            policy_version=version,
            tolerance=tolerance,
            routes=routes,
        )
    )
    return checks, seen


def shifted(*deltas: float) -> list[float]:
    return [t + d for t, d in zip(TRAINER, deltas, strict=True)]


EXACT = shifted(0.0, 0.0, 0.0, 0.0, 0.0)
FLIPPED = shifted(0.3, 0.3, 0.3, 0.3, 0.3)
"""A probe a routing flip moved whole (measured: a probe median up to 0.18)."""


def test_without_routes_a_probe_a_flip_moved_passes_and_is_measured() -> None:
    near = Engine(shifted(0.01, -0.02, 0.0, 0.03, 0.01))
    # One probe moved whole by a flip, one near-tie token far off in another: the
    # median over all 15 tokens stays small, so the check passes.
    tie = Engine([FLIPPED, shifted(0.0, 1.9, 0.02, 0.01, 0.0), EXACT])
    checks, seen = run([near, tie])
    for engine in (near, tie):
        assert [r["prompt_token_ids"] for r in engine.requests] == PROMPTS
        for request in engine.requests:
            params = request["sampling_params"]
            assert params["temperature"] == 0.0 and params["max_tokens"] == PROBE_TOKENS
            assert "return_routed_experts" not in request
    # One forward for both engines' probes, scored with the trainer's own routing.
    (batch,) = seen
    assert batch.batch_size == 2 * len(PROMPTS) and batch.routed_experts is None
    assert batch.loss_mask.sum().item() == 2 * len(PROMPTS) * len(TRAINER)
    assert [c.url for c in checks] == ["http://engine0", "http://engine1"]
    assert not checks[1].replayed_routes and checks[1].tokens == 15
    assert checks[0].median_abs_logp_diff == pytest.approx(0.01)
    assert checks[1].probe_medians == pytest.approx((0.3, 0.01, 0.0))
    assert checks[1].median_abs_logp_diff == pytest.approx(0.01)
    assert checks[1].worst_probe == 1 and checks[1].worst_position == 1
    assert checks[1].worst_token_id == 101
    assert checks[1].worst_abs_logp_diff == pytest.approx(1.9)
    metrics = check_metrics(checks)
    assert metrics["served_weights/max_abs_logp_diff"] == pytest.approx(1.9)
    assert metrics["served_weights/mean_abs_logp_diff"] == pytest.approx((1.5 + 1.93) / 15)
    assert metrics["served_weights/median_abs_logp_diff"] == pytest.approx(0.01)
    assert metrics["served_weights/replayed_routes"] == 0.0


def test_with_routes_the_trainer_replays_them_and_every_probe_must_match() -> None:
    exact = Engine(EXACT)
    checks, seen = run([exact], routes=True)
    assert all(r["return_routed_experts"] is True for r in exact.requests)
    (batch,) = seen
    # The engine's routes reach the trainer as a training batch carries them.
    assert batch.routed_experts is not None and batch.routed_experts.shape[2:] == (LAYERS, TOPK)
    assert batch.routed_experts.rectangle()[..., 1].max() == 1
    assert checks[0].replayed_routes and check_metrics(checks)["served_weights/replayed_routes"]
    # Under one routing a probe moved whole is wrong weights, not a flip: refused.
    moved = Engine([EXACT, FLIPPED, EXACT])
    with pytest.raises(ServedWeightsError) as info:
        run([moved], routes=True)
    assert info.value.check.median_abs_logp_diff == pytest.approx(0.3)
    assert "expected every probe's median |served - trainer| logprob (engine routes " in str(
        info.value
    )
    assert "got 0.3 (medians [0, 0.3, 0]," in str(info.value)
    run([Engine([EXACT, FLIPPED, EXACT])], routes=False)  # the same probes pass unreplayed


def test_an_engine_with_other_weights_stops_the_run_naming_it_and_its_worst_token() -> None:
    good = Engine(EXACT)
    wrong = Engine(shifted(0.5, -1.5, 0.4, 4.75, -0.3))
    for routes in (False, True):
        with pytest.raises(ServedWeightsError) as info:
            run([good, wrong], routes=routes)
        err = info.value
        assert isinstance(err, SkyRLTrainError) and isinstance(err, ValueError)
        assert err.url == "http://engine1" and err.policy_version == 3
        assert err.check.worst_position == 3 and err.check.worst_token_id == 103
        text = str(err)
        assert text.startswith("engine http://engine1 after the push of policy version 3: ")
        assert "generator.inference_engine.verify_weights_tolerance: expected " in text
        assert f"<= 0.1 over 3 probe(s) of up to {PROBE_TOKENS} greedy tokens" in text
        assert "got 0.5 (medians [0.5, 0.5, 0.5], mean 1.49)" in text
        assert "worst: probe 0 token 3 (id 103), served 1.7500, trainer -3.0000" in text
    assert "over all probes' tokens (no routes: trainer routing" in str(
        pytest.raises(ServedWeightsError, run, [wrong]).value
    )


def test_the_bound_is_inclusive() -> None:
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
    logprobs = list(EXACT)
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


def test_an_engine_without_logprobs_or_requested_routes_fails() -> None:
    with pytest.raises(ServedWeightsError, match="expected logprobs of the probe's tokens"):
        run([Engine(None)])
    with pytest.raises(ServedWeightsError, match="expected the probe's routes") as info:
        run([Engine(TRAINER, routed_experts=None)], routes=True)
    assert "enable_return_routed_experts is true" in str(info.value)


def test_probe_prompts_are_the_first_distinct_ones_read_lazily() -> None:
    read: list[int] = []

    def rendered(rows: list[list[int]]) -> Any:
        for i, row in enumerate(rows):
            read.append(i)
            yield row

    rows = [[1], [1], [2], [1], [3], [4], [5], [6]]
    assert probe_prompts(rendered(rows)) == [[1], [2], [3], [4]][:PROBE_PROMPTS]
    # Stops once it has enough: the rest of a large dataset is never rendered.
    assert len(read) == 6
    assert probe_prompts(iter([[7], [7]])) == [[7]]  # fewer when there are fewer
    # A dataset whose first rows repeat one prompt reads PROBE_ROWS_SCANNED rows at most.
    read.clear()
    assert probe_prompts(rendered([[9]] * 1000)) == [[9]]
    assert len(read) == PROBE_ROWS_SCANNED
    with pytest.raises(ValueError, match="at least one training prompt"):
        probe_prompts(iter([]))


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
