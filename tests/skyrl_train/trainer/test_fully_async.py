"""trainer.fully_async: generation for the next steps runs while a step trains, no
trajectory is older than max_staleness_steps, and weight versions only go up. A fake
server (a shared version a push sets, read by each generated turn) and a slow fake
policy; the real loop schedules them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from skyrl_train.config.compose import load_config
from skyrl_train.config.validate import validate_cfg
from skyrl_train.errors import ConfigValidationError
from skyrl_train.generators.base import GeneratorOutput
from skyrl_train.trainer import loop as loop_module
from skyrl_train.trainer.loop import GRPOLoop


class FakeServers:
    """The policy version the servers hold, and every event in order."""

    def __init__(self) -> None:
        self.version = 0
        self.events: list[tuple[float, str, int]] = []


class SlowGenerator:
    """Two turns per trajectory, each reading the version the servers hold then."""

    servers: FakeServers
    turn_s: float

    def __init__(self, *args: object, **kwargs: Any) -> None:
        self.evaluation = kwargs.get("evaluation", False)

    async def generate(self, inputs: Any, *, seed: int | None = None) -> GeneratorOutput:
        rows = len(inputs.prompts)
        self.servers.events.append((time.perf_counter(), "generate", self.servers.version))
        versions = []
        for _ in range(2):
            versions.append(self.servers.version)
            await asyncio.sleep(self.turn_s)
        rewards = [float(i % 2) for i in range(rows)]
        return GeneratorOutput(
            prompt_token_ids=[[1, 2, 3]] * rows,
            response_ids=[[4, 5, 6]] * rows,
            loss_masks=[[1, 0, 1]] * rows,
            rewards=rewards,
            token_rewards=[[0.0, 0.0, r] for r in rewards],
            stop_reasons=["done"] * rows,
            rollout_metrics={},
            rollout_logprobs=[[-1.0, 0.0, -1.0]] * rows,
            policy_versions=[(min(versions), max(versions))] * rows,
        )


class SlowPolicy:
    def __init__(self, servers: FakeServers, train_s: float) -> None:
        self.servers = servers
        self.train_s = train_s
        self.pushed: list[int] = []

    async def train(self, batch: Any, advantages: torch.Tensor, *, step: int) -> Any:
        self.servers.events.append((time.perf_counter(), "train", step))
        await asyncio.sleep(self.train_s)
        return {"train/policy_loss": 0.0}

    async def push_weights(
        self, urls: list[str], *, api_key: str | None = None, policy_version: int | None = None
    ) -> Any:
        assert policy_version is not None
        self.pushed.append(policy_version)
        self.servers.version = policy_version
        self.servers.events.append((time.perf_counter(), "push", policy_version))
        return {}


def _run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *overrides: str,
    turn_s: float = 0.01,
    train_s: float = 0.06,
) -> Any:
    """Generation (two turns) faster than training by default, so it can run ahead."""
    servers = FakeServers()
    SlowGenerator.servers, SlowGenerator.turn_s = servers, turn_s
    monkeypatch.setattr(loop_module, "GymGenerator", SlowGenerator)
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=2",
            "generator.n_samples_per_prompt=2",
            "trainer.micro_train_batch_size_per_gpu=4",
            "trainer.num_steps=6",
            "trainer.eval_interval=0",
            "trainer.algorithm.use_tis=true",
            "logging.progress_bar=false",
            # Fake engines serve no weights to check (test_served_weights.py does).
            "generator.inference_engine.verify_weights_interval=0",
            # A fake policy holds no model to export (test_main_base*.py export one).
            "trainer.hf_save_interval=-1",
            *overrides,
        ]
    )
    validate_cfg(cfg)
    policy = SlowPolicy(servers, train_s)
    loop = GRPOLoop(
        cfg, tokenizer=None, server_urls=["http://127.0.0.1:9"], policy=policy, pad_token_id=0
    )
    history = asyncio.run(loop.run())
    return history, policy, servers


@pytest.mark.parametrize("bound", [1, 2])
def test_staleness_stays_within_the_bound_and_versions_go_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bound: int
) -> None:
    history, policy, servers = _run(
        tmp_path,
        monkeypatch,
        "trainer.fully_async.enabled=true",
        f"trainer.fully_async.max_staleness_steps={bound}",
    )
    assert policy.pushed == [1, 2, 3, 4, 5, 6]  # one push a step, monotone
    for step, metrics in enumerate(history, start=1):
        assert metrics["async/trained_version"] == step - 1
        assert 0 <= metrics["async/staleness_max"] <= bound, (step, metrics)
    # Generation really ran ahead: the bound was reached, and some step's generation
    # started before the previous step's push.
    assert max(m["async/staleness_max"] for m in history) == bound
    generations = [e for e in servers.events if e[1] == "generate"]
    pushes = [e for e in servers.events if e[1] == "push"]
    assert generations[2][0] < pushes[1][0]  # step 3 generating before step 2 pushed


def test_a_trajectory_spanning_a_push_keeps_both_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A training step shorter than a turn: its push lands between two turns.
    history, _, _ = _run(
        tmp_path, monkeypatch, "trainer.fully_async.enabled=true", turn_s=0.06, train_s=0.03
    )
    assert any(m["async/spanning_push_frac"] > 0 for m in history)
    assert all(m["async/staleness_max"] <= 1 for m in history)


def test_sync_runs_train_the_policy_that_generated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    history, policy, servers = _run(tmp_path, monkeypatch)
    assert policy.pushed == [1, 2, 3, 4, 5, 6]
    assert all(m["async/staleness_max"] == 0 for m in history)
    kinds = [kind for _, kind, _ in servers.events]
    assert kinds == ["generate", "train", "push"] * 6  # nothing overlaps


def test_a_failing_step_stops_the_generation_running_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("trainer died")

    monkeypatch.setattr(SlowPolicy, "train", fail)
    with pytest.raises(RuntimeError, match="trainer died"):
        _run(tmp_path, monkeypatch, "trainer.fully_async.enabled=true")
    # asyncio.run would have warned about (and cancelled) a pending producer; the loop
    # cancelled it itself, so no task is left.


def test_fully_async_needs_the_off_policy_correction() -> None:
    cfg = load_config(["trainer.fully_async.enabled=true"])
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    assert info.value.path == "trainer.algorithm.off_policy_correction.tis_ratio_type"
