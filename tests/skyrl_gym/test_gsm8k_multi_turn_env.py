"""gsm8k_multi_turn: a reward every turn, the episode ends on a right answer or at
max_turns, observations ask again and then for the final answer."""

from __future__ import annotations

import random

import numpy as np
import pytest

import skyrl_gym
from skyrl_gym import EnvError
from skyrl_gym.envs.gsm8k import GSM8kEnv, GSM8kMultiTurnEnv
from skyrl_gym.envs.gsm8k.multi_turn_env import ASK_AGAIN, ASK_FINAL

SPEC = {"method": "rule", "ground_truth": "7"}


def env(**extras) -> GSM8kMultiTurnEnv:
    made = skyrl_gym.make(
        "gsm8k_multi_turn", env_config=None, extras={"reward_spec": SPEC, **extras}
    )
    assert isinstance(made, GSM8kMultiTurnEnv)
    return made


def test_a_right_answer_on_the_first_turn_scores_one_and_ends() -> None:
    e = env(max_turns=4)
    assert e.init([{"role": "user", "content": "q"}]) == ([{"role": "user", "content": "q"}], {})
    out = e.step("3 + 4 = 7\n#### 7")
    assert out == {
        "observations": [],
        "reward": 1.0,
        "done": True,
        "metadata": {"solved": True, "turn": 0},
    }
    assert e.get_metrics() == {"steps": 1}


def test_a_marked_wrong_answer_earns_the_format_share_and_asks_again() -> None:
    e = env(max_turns=4)
    out = e.step("#### 8")
    assert out["reward"] == pytest.approx(0.2 / 4) and not out["done"]
    assert out["observations"] == [{"role": "user", "content": ASK_AGAIN}]
    assert out["metadata"]["solved"] is False
    assert e.step("#### 7")["reward"] == 1.0  # a later right answer still counts


def test_the_last_but_one_observation_asks_for_the_final_answer_and_max_turns_ends() -> None:
    e = env(max_turns=3)
    contents = []
    for turn in range(3):
        out = e.step("#### 1")
        assert out["reward"] == pytest.approx(0.2 / 3)
        assert out["done"] is (turn == 2)
        contents.append([m["content"] for m in out["observations"]])
    assert contents == [[ASK_AGAIN], [ASK_FINAL], []]
    assert e.get_metrics() == {"steps": 3}


def test_one_turn_ends_at_once_with_the_whole_format_share() -> None:
    out = env(max_turns=1).step("#### 8")
    assert out["done"] and out["observations"] == [] and out["reward"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    "reply", ["7", "the answer is 7", "", "####", "\\boxed{}", "#### seven", "####7x"]
)
def test_unmarked_or_unreadable_replies_score_zero(reply: str) -> None:
    out = env(max_turns=2).step(reply)
    assert out["reward"] == 0.0 and not out["done"] and out["metadata"]["solved"] is False


@pytest.mark.parametrize(
    "reply", [b"\xff\xfe#### 7", b"\x00" * 50, "\ud800", "#" * 10_000, None, 12345, ["#### 7"]]
)
def test_bytes_and_garbage_never_raise(reply) -> None:
    out = env(max_turns=2).step(reply)
    assert out["reward"] == (1.0 if reply == b"\xff\xfe#### 7" else 0.0)
    skyrl_gym.read_step_output(out, env="gsm8k_multi_turn", turn=0)


@pytest.mark.parametrize(
    ("extras", "expected"),
    [
        ({}, 5),
        ({"extra_info": {"max_turns": 3}}, 3),
        ({"max_turns": 2, "extra_info": {"max_turns": 3}}, 2),  # the row's field wins
        ({"max_turns": None, "extra_info": {"max_turns": 3}}, 3),  # a null column: absent
        ({"max_turns": float("nan")}, 5),  # pandas' null
        ({"max_turns": np.int64(4)}, 4),
        ({"max_turns": "6"}, 6),
        ({"max_turns": 3.0}, 3),
        ({"max_turns": 100}, 100),  # the generator's limit, whatever the run sets
        ({"extra_info": None}, 5),
    ],
)
def test_max_turns_comes_from_extras_then_extra_info_then_five(extras, expected) -> None:
    e = env(**extras)
    assert e.max_turns == expected
    assert e.format_score_per_turn == pytest.approx(0.2 / expected)


@pytest.mark.parametrize(
    ("extras", "match"),
    [
        ({"max_turns": 0}, r"gsm8k_multi_turn.extras.max_turns: expected an int >= 1, got 0"),
        ({"max_turns": True}, r"extras.max_turns: expected an int >= 1, got True"),
        ({"max_turns": 2.5}, r"extras.max_turns: expected an int >= 1, got 2.5"),
        ({"max_turns": "many"}, r"extras.max_turns: expected an int >= 1, got 'many'"),
        ({"extra_info": {"max_turns": -1}}, r"extras.extra_info.max_turns: expected an int"),
        ({"extra_info": [1]}, r"gsm8k_multi_turn.extra_info: expected a mapping"),
    ],
)
def test_bad_max_turns_name_the_field(extras, match) -> None:
    with pytest.raises(EnvError, match=match):
        env(**extras)


def test_bad_rows_and_settings_name_the_field() -> None:
    with pytest.raises(EnvError, match=r"gsm8k_multi_turn.reward_spec: expected a mapping"):
        GSM8kMultiTurnEnv(None, {})
    with pytest.raises(EnvError, match=r"gsm8k_multi_turn.extras: expected a mapping"):
        GSM8kMultiTurnEnv(None, ["reward_spec"])
    with pytest.raises(EnvError, match=r"environment.skyrl_gym.gsm8k_multi_turn: .*\['max_turn'\]"):
        GSM8kMultiTurnEnv({"max_turn": 3}, {"reward_spec": SPEC})


def test_a_step_after_done_raises() -> None:
    e = env(max_turns=2)
    e.step("#### 7")
    with pytest.raises(EnvError, match=r"gsm8k_multi_turn.step: expected an unfinished episode"):
        e.step("#### 7")
    e = env(max_turns=1)
    e.step("nothing")
    with pytest.raises(EnvError, match=r"step 2 after done \(max_turns 1\)"):
        e.step("#### 7")


def test_metrics_count_steps_and_average_them() -> None:
    e = env(max_turns=3)
    assert e.get_metrics() == {"steps": 0}
    e.step("#### 1")
    e.step("#### 7")
    assert e.get_metrics() == {"steps": 2}
    episodes = [{"steps": 1}, {"steps": 2}, {"steps": 6}, {}]
    assert GSM8kMultiTurnEnv.aggregate_metrics(episodes) == {"avg_steps": 2.25}
    assert GSM8kMultiTurnEnv.aggregate_metrics([]) == {}
    aggregated = skyrl_gym.metrics.aggregate_for_environment("gsm8k_multi_turn", episodes)
    assert aggregated == {"avg_steps": 2.25}


def test_sample_task_mirrors_gsm8k_and_builds_a_playable_episode() -> None:
    for difficulty in (1, 2):
        mine = GSM8kMultiTurnEnv.sample_task(random.Random(3), difficulty=difficulty)
        theirs = GSM8kEnv.sample_task(random.Random(3), difficulty=difficulty)
        assert mine == theirs
    tasks = skyrl_gym.make_dataset("gsm8k_multi_turn", num_prompts=4, seed=1)
    assert tasks == skyrl_gym.make_dataset("gsm8k_multi_turn", num_prompts=4, seed=1)
    for task in tasks:
        assert task.env_name == "gsm8k_multi_turn" and "max_turns" not in task.env_extras
        e = skyrl_gym.make_task_env(task.env_name, task.env_extras, max_turns=2)
        assert e.max_turns == 2
        truth = task.env_extras["reward_spec"]["ground_truth"]
        assert e.step(f"#### {truth}")["reward"] == 1.0
