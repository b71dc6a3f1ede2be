"""What a step's rollout dump records of each trajectory (``trainer/rollout_dumps.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from inference.models.tokenizer import build_byte_tokenizer
from skyrl_train.generators.base import GeneratorOutput
from skyrl_train.runs.rollouts import list_dumps, read_dump, write_dump
from skyrl_train.trainer.rollout_dumps import Inspection, RolloutDumper, expert_load, turns

TOKENIZER = build_byte_tokenizer()
L, K, E = 3, 2, 4


def output(n: int = 4) -> GeneratorOutput:
    """``n`` two-turn trajectories: prompt "hi", reply "ab", observation "?", reply "c"."""
    prompt = TOKENIZER.encode("hi", add_special_tokens=False)
    response = TOKENIZER.encode("ab?c", add_special_tokens=False)
    rng = np.random.default_rng(0)
    return GeneratorOutput(
        prompt_token_ids=[list(prompt)] * n,
        response_ids=[list(response)] * n,
        loss_masks=[[1, 1, 0, 1]] * n,
        rewards=[float(i) for i in range(n)],
        token_rewards=[[0.0, 0.25, 0.0, i - 0.25] for i in range(n)],
        stop_reasons=["done"] * n,
        rollout_metrics={},
        rollout_logprobs=[[-0.5, -1.25, 0.0, -2.0]] * n,
        routed_experts=[rng.integers(0, E, size=(5, L, K), dtype=np.uint8) for _ in range(n)],
        solved=[i % 2 == 0 for i in range(n)],
        turn_versions=[[[0], [0, 1]]] * n,
    )


def test_turns_are_the_runs_of_sampled_tokens_with_their_rewards_and_versions() -> None:
    got = turns([1, 1, 0, 0, 1], [0.0, 0.5, 0.0, 0.0, 0.25], [[3], None])
    assert got == [
        {"start": 0, "end": 2, "reward": 0.5, "policy_versions": [3]},
        {"start": 4, "end": 5, "reward": 0.25, "policy_versions": None},
    ]
    assert turns([0, 0], [0.0, 0.0], None) == []


def test_expert_load_counts_every_routed_token_per_layer() -> None:
    routes = [np.array([[[0, 1]], [[1, 3]]]), np.array([[[3, 2]]])]  # L=1, K=2
    assert expert_load(routes, num_experts=5) == [[1, 2, 1, 2, 0]]
    assert expert_load(routes, num_experts=None) == [[1, 2, 1, 2]]  # widest id seen
    assert expert_load(None, 4) is None and expert_load([], 4) is None


def test_a_train_dump_holds_the_first_rows_with_the_trainers_view(tmp_path: Path) -> None:
    out = output()
    dumper = RolloutDumper(tmp_path, count=2, tokenizer=TOKENIZER, group_size=2, start_step=0)
    advantages = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 3
    # Batch layout: 3 prompt columns (left padded), then 4 response columns.
    flips = torch.zeros(2, 7, L, dtype=torch.bool)
    flips[1, 3 + 1, 2] = True  # row 1, response token 1, layer 2
    flips[0, 1, 0] = True  # a prompt column: not a response token
    inspection = Inspection(
        torch.full((2, 4), -0.123456789), flips, torch.ones(2, 7, L, dtype=torch.bool)
    )
    path = dumper.write_train(
        7, out, advantages=advantages, inspection=inspection, prompt_width=3,
        sources=[("src", "env")] * 4,
    )  # fmt: skip
    doc = read_dump(path)
    assert (doc["step"], doc["kind"], doc["group_size"], doc["num_layers"]) == (7, "train", 2, L)
    load = np.array(doc["expert_load"])
    assert load.shape == (L, E) and (load.sum(axis=1) == 4 * 5 * K).all()  # every routed token
    first, second = doc["trajectories"]
    assert [t["index"] for t in doc["trajectories"]] == [0, 1]
    assert (second["group"], second["sample"], second["solved"]) == (0, 1, False)
    assert first["tokens"] == ["a", "b", "?", "c"] and first["prompt_text"] == "hi"
    assert first["trainer_logprobs"] == [-0.12346] * 4  # rounded to 5 decimals
    assert first["advantages"] == pytest.approx([0.0, 0.33333, 0.66667, 1.0])
    assert first["rollout_logprobs"] == [-0.5, -1.25, 0.0, -2.0]
    assert first["router_flips"] == [[], [], [], []]
    assert second["router_flips"] == [[], [2], [], []]
    assert second["router_flips_native"] == [[0, 1, 2]] * 4
    assert first["turns"] == [
        {"start": 0, "end": 2, "reward": 0.25, "policy_versions": [0]},
        {"start": 3, "end": 4, "reward": -0.25, "policy_versions": [0, 1]},
    ]
    assert (first["data_source"], first["env_class"]) == ("src", "env")


def test_without_the_trainers_view_or_sources_those_fields_are_null(tmp_path: Path) -> None:
    out = output(3)
    out.routed_experts = None
    dumper = RolloutDumper(tmp_path, count=8, tokenizer=TOKENIZER, group_size=3, start_step=0)
    path = dumper.write_train(
        1, out, advantages=torch.zeros(3, 4), inspection=None, prompt_width=2, sources=None
    )
    doc = read_dump(path)
    assert len(doc["trajectories"]) == 3  # fewer rows than asked for: all of them
    assert doc["expert_load"] is None and doc["num_layers"] is None
    row = doc["trajectories"][0]
    assert row["trainer_logprobs"] is None and row["router_flips"] is None
    assert row["data_source"] is None


def test_an_eval_dump_groups_by_its_own_sample_count(tmp_path: Path) -> None:
    dumper = RolloutDumper(tmp_path, count=3, tokenizer=TOKENIZER, group_size=8, start_step=0)
    doc = read_dump(dumper.write_eval(10, output(4), group_size=1, sources=None))
    assert doc["kind"] == "eval" and doc["group_size"] == 1
    assert [t["group"] for t in doc["trajectories"]] == [0, 1, 2]
    assert all(t["advantages"] is None for t in doc["trajectories"])


def test_a_dumper_starting_after_a_step_drops_the_later_dumps(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        write_dump(tmp_path, {"step": step, "kind": "train", "trajectories": []})
    dumper = RolloutDumper(tmp_path, count=0, tokenizer=TOKENIZER, group_size=2, start_step=1)
    assert not dumper.enabled
    assert [ref.step for ref in list_dumps(tmp_path)] == [1]
