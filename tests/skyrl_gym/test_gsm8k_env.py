"""The gsm8k environment: dataset-row construction, rewards, sampled tasks."""

from __future__ import annotations

import operator
import random
from dataclasses import FrozenInstanceError

import pytest

import skyrl_gym
from skyrl_gym import EnvError
from skyrl_gym.envs.arith_problems import ArithProblem, sample_problem
from skyrl_gym.envs.gsm8k import INSTRUCTION, GSM8kEnv

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
ROW = {
    "prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}],
    "env_class": "gsm8k",
    "reward_spec": {"method": "rule", "ground_truth": "7"},
    "data_source": "openai/gsm8k",
    "extra_info": {"split": "test", "index": 0},
}


def reward(reply: str | bytes, truth="7", **options) -> tuple[float, dict]:
    """Builds the env the way the dataset loader does, and plays one turn."""
    extras = {"reward_spec": {"method": "rule", "ground_truth": truth}, "extra_info": {}}
    env = skyrl_gym.make("gsm8k", env_config=options, extras=extras)
    prompt, info = env.init(ROW["prompt"])
    assert prompt == ROW["prompt"] and info == {}
    out = env.step(reply)
    assert out["done"] and out["observations"] == []
    return out["reward"], out["metadata"]


def test_a_dataset_row_builds_the_env_as_the_loader_does() -> None:
    extras = {k: v for k, v in ROW.items() if k not in ("prompt", "env_class")}
    env = skyrl_gym.make(ROW["env_class"], env_config=None, extras=extras)
    assert isinstance(env, GSM8kEnv) and env.strict  # SkyRL's default: only "#### N" counts
    assert env.ground_truth == "7" and env.extra_info == {"split": "test", "index": 0}
    bare = skyrl_gym.make("gsm8k", extras={"reward_spec": {"method": "rule", "ground_truth": 7}})
    assert bare.extra_info == {}


@pytest.mark.parametrize(
    ("reply", "truth", "options", "expected", "solved", "extracted"),
    [
        ("3 + 4 = 7\n#### 7", "7", {}, 1.0, True, "7"),
        ("\\boxed{7}", "7", {}, 1.0, True, "7"),
        ("3 + 4 = 7", "7", {"strict": False}, 1.0, True, "7"),  # lenient: the last number
        ("3 + 4 = 7", "7", {}, 0.0, False, None),  # strict by default, as SkyRL's
        ("#### 8", "7", {}, 0.0, False, "8"),
        ("#### 8", "7", {"format_reward": 0.1}, 0.1, False, "8"),
        ("\\boxed{8}", "7", {"format_reward": 0.1}, 0.1, False, "8"),
        ("it is 8", "7", {"format_reward": 0.1, "strict": False}, 0.0, False, "8"),  # no bonus
        ("#### 7.00", "7", {}, 1.0, True, "7"),
        ("#### 1,000", "1000", {}, 1.0, True, "1000"),
        ("#### 1000", "1,000", {}, 1.0, True, "1000"),
        ("#### \u22123", "-3", {}, 1.0, True, "-3"),
        ("#### 0.5", 0.5, {}, 1.0, True, "0.5"),
        ("#### 7\n#### 8", "7", {}, 0.0, False, "8"),  # the last marker is the answer
        ("", "7", {}, 0.0, False, None),
        (b"\xff\xfe#### 7", "7", {}, 1.0, True, "7"),
    ],
)
def test_rewards(reply, truth, options, expected, solved, extracted) -> None:
    got, metadata = reward(reply, truth, **options)
    assert got == expected
    assert metadata == {"solved": solved, "extracted": extracted, "turn": 0}


def test_bad_options_and_reward_specs_name_the_field() -> None:
    good = {"method": "rule", "ground_truth": "7"}
    extras = {"reward_spec": good}
    with pytest.raises(
        EnvError, match=r"skyrl_gym.gsm8k.format_reward: expected a number in \[0, 1\], got 2"
    ):
        skyrl_gym.make("gsm8k", env_config={"format_reward": 2}, extras=extras)
    with pytest.raises(EnvError, match=r"skyrl_gym.gsm8k.strict: expected a bool, got 'yes'"):
        skyrl_gym.make("gsm8k", env_config={"strict": "yes"}, extras=extras)
    with pytest.raises(EnvError, match=r"gsm8k.reward_spec.method: expected one of \['rule'\]"):
        skyrl_gym.make(
            "gsm8k", extras={"reward_spec": {"method": "llm_judge", "ground_truth": "7"}}
        )
    with pytest.raises(EnvError, match=r"gsm8k.reward_spec.ground_truth: .*got 'x'"):
        skyrl_gym.make("gsm8k", extras={"reward_spec": {"method": "rule", "ground_truth": "x"}})
    with pytest.raises(EnvError, match=r"gsm8k.extra_info: expected a mapping or None"):
        skyrl_gym.make("gsm8k", extras={**extras, "extra_info": "split=train"})
    with pytest.raises(EnvError, match=r"make\('gsm8k'\).kwargs"):
        skyrl_gym.make("gsm8k", extras=extras, max_turns=3)
    with pytest.raises(EnvError, match=r"gsm8k.reward_spec: expected a mapping"):
        skyrl_gym.make("gsm8k")  # reward_spec is required


def test_arith_problems_are_deterministic_well_formed_and_varied() -> None:
    for difficulty in (1, 2, 3):
        problems = [sample_problem(random.Random(i), difficulty=difficulty) for i in range(200)]
        again = [sample_problem(random.Random(i), difficulty=difficulty) for i in range(200)]
        assert problems == again
        assert len({p.question for p in problems}) > 150
        for p in problems:
            assert isinstance(p, ArithProblem) and isinstance(p.answer, int) and p.answer >= 0
            assert p.solution.splitlines()[-1] == f"#### {p.answer}"
            for step in p.solution.splitlines()[:-1]:  # every worked step is true arithmetic
                lhs, rhs = step.split(" = ")
                a, op, b = lhs.split()
                assert OPS[op](int(a), int(b)) == int(rhs), step
    with pytest.raises(FrozenInstanceError):
        problems[0].answer = 3  # type: ignore[misc]
    with pytest.raises(EnvError, match=r"arith_problems.difficulty: expected an int in \[1, 3\]"):
        sample_problem(random.Random(0), difficulty=4)
    # The generator advances, so one rng gives a stream of different problems.
    rng = random.Random(7)
    assert sample_problem(rng) != sample_problem(rng)


def test_sampled_tasks_are_seeded_and_solvable_with_their_solution() -> None:
    tasks = skyrl_gym.make_dataset("gsm8k", num_prompts=30, seed=1, difficulty=2)
    assert tasks == skyrl_gym.make_dataset("gsm8k", num_prompts=30, seed=1, difficulty=2)
    assert tasks != skyrl_gym.make_dataset("gsm8k", num_prompts=30, seed=2, difficulty=2)
    for task in tasks:
        assert task.prompt[0]["content"].endswith(INSTRUCTION)
        assert set(task.env_extras) == {"reward_spec", "extra_info"}
        env = skyrl_gym.make(task.env_name, extras=task.env_extras)
        env.init(task.prompt)
        assert env.step(task.env_extras["extra_info"]["solution"])["reward"] == 1.0
        env = skyrl_gym.make(task.env_name, extras=task.env_extras)
        env.init(task.prompt)
        assert env.step("#### -1")["reward"] == 0.0


def test_arbitrary_bytes_never_crash_and_rewards_stay_in_unit_range() -> None:
    rng = random.Random(0)
    for task in skyrl_gym.make_dataset("gsm8k", num_prompts=50, seed=0):
        env = skyrl_gym.make(
            task.env_name, env_config={"format_reward": 0.2}, extras=task.env_extras
        )
        env.init(task.prompt)
        reply = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
        out = env.step(b"#### " + reply if rng.random() < 0.5 else reply)
        assert 0.0 <= out["reward"] <= 1.0 and out["done"]
        with pytest.raises(EnvError, match="after done"):
            env.step("#### 1")
