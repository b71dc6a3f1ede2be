"""Dynamic sampling plans (filter, replace) and the output surgery they drive."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import skyrl_gym
from inference.models.tokenizer import build_byte_tokenizer
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_train.algorithms.dynamic_sampling import (
    plan_filter,
    plan_replace,
    trajectory_indices,
    varying_groups,
)
from skyrl_train.algorithms.signals import success_rate
from skyrl_train.config.compose import load_config
from skyrl_train.dataset.preprocess import convert_to_training_batch
from skyrl_train.dataset.prompts import PromptDatasets
from skyrl_train.generators.base import GeneratorOutput, concat_outputs
from skyrl_train.trainer import loop as loop_module
from skyrl_train.trainer.loop import GRPOLoop


def test_varying_groups_marks_groups_whose_rewards_differ() -> None:
    rewards = [1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.2, 0.3]
    assert varying_groups(rewards, 2) == [True, False, False, True]
    assert varying_groups(rewards, 4) == [True, True]
    assert varying_groups([0.7], 1) == [False]  # a group of one is flat


def test_varying_groups_refuses_a_ragged_batch() -> None:
    with pytest.raises(ValueError, match="multiple of group_size 3"):
        varying_groups([1.0, 0.0, 1.0, 0.0], 3)


def test_filter_takes_varying_groups_in_sampled_order_then_fills_with_flat_ones() -> None:
    rounds = [[True, False, False], [False, True, True]]
    assert plan_filter(rounds, 3) == [(0, 0), (1, 1), (1, 2)]
    # Too few vary: the flat ones, in sampled order, fill the batch.
    assert plan_filter([[False, True], [False, False]], 2) == [(0, 1), (0, 0)]
    with pytest.raises(ValueError, match="at least 7 groups in all, got 6"):
        plan_filter(rounds, 7)


def test_replace_copies_varying_groups_over_flat_ones() -> None:
    varying = [True, False, True, False]
    plan = plan_replace(varying, min_replace_ratio=0.5, rng=random.Random(0))
    assert plan[0] == 0 and plan[2] == 2  # varying groups keep their slots
    assert plan[1] in (0, 2) and plan[3] in (0, 2)
    # Deterministic for a seeded rng.
    assert plan == plan_replace(varying, min_replace_ratio=0.5, rng=random.Random(0))


def test_replace_leaves_the_batch_alone_below_the_ratio_or_with_nothing_to_copy() -> None:
    rng = random.Random(0)
    assert plan_replace([True, False, False, False], min_replace_ratio=0.3, rng=rng) == [0, 1, 2, 3]
    assert plan_replace([False, False], min_replace_ratio=0.0, rng=rng) == [0, 1]


def test_trajectory_indices_expand_whole_groups() -> None:
    assert trajectory_indices([2, 0, 2], 2) == [4, 5, 0, 1, 4, 5]


def _output(tag: int, rows: int, *, routes: bool = True) -> GeneratorOutput:
    return GeneratorOutput(
        prompt_token_ids=[[tag, i] for i in range(rows)],
        response_ids=[[tag * 10 + i] for i in range(rows)],
        loss_masks=[[1] for _ in range(rows)],
        rewards=[float(tag * 10 + i) for i in range(rows)],
        token_rewards=[[float(i)] for i in range(rows)],
        stop_reasons=[f"r{tag}{i}" for i in range(rows)],
        rollout_metrics={"generate/wall_s": float(tag)},
        rollout_logprobs=[[-float(i)] for i in range(rows)],
        routed_experts=[np.full((2, 1, 2), tag * 10 + i) for i in range(rows)] if routes else None,
        solved=[i % 2 == 0 for i in range(rows)],
    )


def test_take_moves_every_per_trajectory_field_together() -> None:
    out = _output(1, 4).take([3, 1, 3])
    assert out.rewards == [13.0, 11.0, 13.0]
    assert out.prompt_token_ids == [[1, 3], [1, 1], [1, 3]]
    assert out.stop_reasons == ["r13", "r11", "r13"]
    assert out.rollout_logprobs == [[-3.0], [-1.0], [-3.0]]
    assert out.solved == [False, False, False]
    assert out.routed_experts is not None
    assert [int(r[0, 0, 0]) for r in out.routed_experts] == [13, 11, 13]
    assert out.rollout_metrics == {"generate/wall_s": 1.0}


def test_take_refuses_an_index_outside_the_output() -> None:
    with pytest.raises(IndexError, match=r"0 <= i < 4, got \[4\]"):
        _output(1, 4).take([0, 4])


def test_concat_keeps_order_and_refuses_a_mix_of_present_and_missing_routes() -> None:
    joined = concat_outputs([_output(1, 2), _output(2, 1)])
    assert joined.rewards == [10.0, 11.0, 20.0]
    assert joined.routed_experts is not None and len(joined.routed_experts) == 3
    assert joined.rollout_metrics == {"generate/wall_s": 1.0}
    with pytest.raises(ValueError, match="routed_experts: expected it in every part"):
        concat_outputs([_output(1, 2), _output(2, 1, routes=False)])
    with pytest.raises(ValueError, match="at least one"):
        concat_outputs([])


def test_concat_refuses_a_mix_of_present_and_missing_logprobs() -> None:
    without = dataclasses.replace(_output(2, 1), rollout_logprobs=None)
    with pytest.raises(ValueError, match="rollout_logprobs: expected it in every part"):
        concat_outputs([_output(1, 2), without])


def test_concat_joins_rounds_with_and_without_solved_as_unknown() -> None:
    reported = _output(1, 2)  # solved [True, False]
    silent = dataclasses.replace(_output(2, 3), solved=None)  # no environment reported
    some = dataclasses.replace(_output(3, 2), solved=[None, True])

    joined = concat_outputs([silent, reported, some])
    assert joined.solved == [None, None, None, True, False, None, True]
    assert joined.rewards == [20.0, 21.0, 22.0, 10.0, 11.0, 30.0, 31.0]
    assert success_rate(joined.solved) == 2 / 3  # the unknown ones are not unsolved
    # No part reported: the field stays None, as one generation without reports has it.
    assert concat_outputs([silent, silent]).solved is None
    assert concat_outputs([silent, dataclasses.replace(some, solved=[None, None])]).solved is None
    # Taking only unreported trajectories leaves the same "none reported" form.
    assert some.take([0, 0]).solved is None and some.take([1, 0]).solved == [True, None]


class _ScoredEnv(BaseTextEnv):
    """One turn. ``vary``: the reply "A" scores 1 and solves, "B" scores 0; otherwise
    every reply scores 0.5. ``report=False``: the metadata never says ``solved``."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.vary, self.report = (extras or {})["vary"], (extras or {})["report"]

    def step(self, action: str) -> BaseTextEnvStepOutput:
        solved = self.vary and action.startswith("A")
        reward = (1.0 if solved else 0.0) if self.vary else 0.5
        metadata = {"solved": solved} if self.report else {}
        return {"observations": [], "reward": reward, "done": True, "metadata": metadata}


class _AlternatingClient:
    """No server: answers the samples of each prompt "A", "B", "A", ... in call order,
    so a group of two always holds one of each."""

    supported_logprobs_modes = ("raw_logprobs", "processed_logprobs")

    def __init__(self, tokenizer: Any) -> None:
        self.replies = [tokenizer.encode(t, add_special_tokens=False) for t in ("A", "B")]
        self.calls: dict[tuple[int, ...], int] = {}

    async def generate(self, *, prompt_token_ids: Any, **kwargs: Any) -> Any:
        seen = self.calls.get(tuple(prompt_token_ids), 0)
        self.calls[tuple(prompt_token_ids)] = seen + 1
        ids = self.replies[seen % 2]
        return SimpleNamespace(
            response_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", routed_experts=None
        )


def test_filter_mixes_a_round_that_reports_solved_with_one_that_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DAPO through the loop and the real GymGenerator: round 0 holds only environments
    that report ``solved`` (one group varies), round 1 only ones that never do (one group
    varies); the batch takes the varying group of each."""

    def task(prompt: str, *, vary: bool, report: bool) -> skyrl_gym.Task:
        extras = {"vary": vary, "report": report}
        return skyrl_gym.Task([{"role": "user", "content": prompt}], "ds_test_scored", extras)

    rounds = [
        [task("r0 varies", vary=True, report=True), task("r0 flat", vary=False, report=True)],
        [task("r1 flat", vary=False, report=False), task("r1 varies", vary=True, report=False)],
    ]
    monkeypatch.setattr(loop_module, "sample_step", lambda *a, round, **k: rounds[round])
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=2",
            "generator.max_turns=1",
            "generator.inference_engine.enable_return_routed_experts=false",
            "trainer.algorithm.dynamic_sampling.type=filter",
            "trainer.algorithm.dynamic_sampling.max_sample_batches=2",
            "logging.progress_bar=false",
        ]
    )
    tokenizer = build_byte_tokenizer()
    loop = GRPOLoop(
        cfg,
        tokenizer=tokenizer,
        server_urls=[],
        policy=None,
        pad_token_id=0,
        datasets=PromptDatasets(train=rounds[0], eval=[]),
    )
    skyrl_gym.register("ds_test_scored", _ScoredEnv)
    try:
        rollout = asyncio.run(loop.rollout(1, [_AlternatingClient(tokenizer)]))
    finally:
        skyrl_gym.deregister("ds_test_scored")

    assert rollout.output.solved == [True, False, False, False]  # round 0 as generated
    chosen = rollout.trained_on
    assert sorted(chosen.rewards[:2]) == [0.0, 1.0] and sorted(chosen.rewards[2:]) == [0.0, 1.0]
    # Round 0's varying group keeps its verdicts, round 1's are unknown.
    assert chosen.solved is not None
    assert chosen.solved[:2] == [r == 1.0 for r in chosen.rewards[:2]]
    assert chosen.solved[2:] == [None, None]
    assert rollout.signals["dynamic_sampling/rounds"] == 2.0
    assert rollout.signals["dynamic_sampling/varying_group_frac"] == 1.0
    assert success_rate(chosen.solved) == 0.5
    batch = convert_to_training_batch(chosen, pad_token_id=0)
    assert batch.batch_size == 4
