"""The in-run evaluation samples each held-out prompt
``generator.eval_n_samples_per_prompt`` times (one by default, as before the key
existed) and its reward means cover every sample, per data source too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from skyrl_gym import Task
from skyrl_train.config.compose import load_config
from skyrl_train.dataset.prompts import PromptDatasets
from skyrl_train.generators.base import GeneratorOutput
from skyrl_train.trainer import loop as loop_module
from skyrl_train.trainer.loop import GRPOLoop


class PositionGenerator:
    """Trajectory i earns reward i; records each call's prompts."""

    calls: list[list[str]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        assert kwargs.get("evaluation") is True

    async def generate(self, inputs: Any, *, seed: int | None = None) -> GeneratorOutput:
        rows = len(inputs.prompts)
        self.calls.append([p[0]["content"] for p in inputs.prompts])
        rewards = [float(i) for i in range(rows)]
        return GeneratorOutput(
            prompt_token_ids=[[1]] * rows,
            response_ids=[[2]] * rows,
            loss_masks=[[1]] * rows,
            rewards=rewards,
            token_rewards=[[r] for r in rewards],
            stop_reasons=["done"] * rows,
            rollout_metrics={},
        )


def task(source: str) -> Task:
    return Task([{"role": "user", "content": source}], "repeat_letter", {}, data_source=source)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (1, {"eval/reward_mean": 0.5, "eval/reward_mean/a": 0.0, "eval/reward_mean/b": 1.0}),
        (3, {"eval/reward_mean": 2.5, "eval/reward_mean/a": 1.0, "eval/reward_mean/b": 4.0}),
    ],
)
def test_eval_samples_each_prompt_n_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int, expected: dict[str, float]
) -> None:
    monkeypatch.setattr(loop_module, "GymGenerator", PositionGenerator)
    monkeypatch.setattr(PositionGenerator, "calls", [])
    overrides = [f"trainer.run_dir={tmp_path}"]
    if n != 1:  # the default stays one sample a prompt
        overrides.append(f"generator.eval_n_samples_per_prompt={n}")
    cfg = load_config(overrides)
    loop = GRPOLoop(
        cfg,
        tokenizer=None,
        server_urls=["http://127.0.0.1:9"],
        policy=None,
        pad_token_id=0,
        datasets=PromptDatasets(train=[task("a")], eval=[task("a"), task("b")]),
    )
    assert asyncio.run(loop.evaluate([object()])) == expected
    assert PositionGenerator.calls == [["a"] * n + ["b"] * n]
