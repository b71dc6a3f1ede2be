"""``lcb``: programs graded in the sandbox on stdin and functional tests."""

from __future__ import annotations

import json

import pytest

import skyrl_gym
from skyrl_gym.envs.lcb import extract_code, outputs_match, parse_tests
from skyrl_gym.error import EnvError

SECOND_LARGEST = [
    {"input": "4\n8 2 5 1\n", "output": "3\n", "testtype": "stdin"},
    {"input": "3\n3 2 1\n", "output": "2\n", "testtype": "stdin"},
]
RIGHT = """Here is my solution.
```python
n = int(input())
a = list(map(int, input().split()))
print(a.index(sorted(a)[-2]) + 1)
```"""
TWO_SUM = [
    {
        "input": "[2, 7, 11, 15]\n9",
        "output": "[0, 1]",
        "testtype": "functional",
        "metadata": {"func_name": "twoSum"},
    },
    {"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional"},
]
TWO_SUM_CODE = """```python
class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return (seen[target - x], i)
            seen[x] = i
```"""


def make(tests, **settings):
    extras = {"reward_spec": {"method": "rule", "ground_truth": json.dumps(tests)}}
    return skyrl_gym.make("lcb", env_config=settings or None, extras=extras)


def step(tests, reply, **settings):
    return make(tests, **settings).step(reply)


def test_right_program_scores_one():
    out = step(SECOND_LARGEST, RIGHT)
    assert out["reward"] == 1.0 and out["done"] and out["observations"] == []
    meta = out["metadata"]
    assert (meta["solved"], meta["passed"], meta["total"], meta["failure"]) == (True, 2, 2, None)
    assert meta["parsed_code"].startswith("n = int(input())")


def test_wrong_program_stops_at_first_failure():
    wrong = (
        "```python\ninput()\na = list(map(int, input().split()))\nprint(a.index(max(a)) + 1)\n```"
    )
    meta = step(SECOND_LARGEST, wrong)["metadata"]
    assert meta["solved"] is False and meta["passed"] == 0
    assert (meta["failure"], meta["status"]) == ("wrong_answer", "ok")


def test_runtime_error_and_main_guard():
    crash = "```python\nprint(1 // 0)\n```"
    out = step(SECOND_LARGEST, crash)
    assert out["reward"] == 0.0 and out["metadata"]["failure"] == "error"
    guarded = RIGHT.replace("n = int", "def main():\n    n = int").replace("\na =", "\n    a =")
    guarded = guarded.replace("\nprint(", "\n    print(").replace(
        "\n```", "\n\nif __name__ == '__main__':\n    main()\n```"
    )
    assert step(SECOND_LARGEST, guarded)["reward"] == 1.0


def test_no_code_block_scores_zero():
    out = step(SECOND_LARGEST, "print(3)")
    assert out["reward"] == 0.0
    assert out["metadata"]["parsed_code"] is None and out["metadata"]["failure"] == "no_code"


def test_functional_tests():
    assert step(TWO_SUM, TWO_SUM_CODE)["reward"] == 1.0
    wrong = TWO_SUM_CODE.replace("(seen[target - x], i)", "[i, seen[target - x]]")
    assert step(TWO_SUM, wrong)["reward"] == 0.0
    plain = "```python\ndef twoSum(nums, target):\n    return [0, 1]\n```"
    meta = step(TWO_SUM[:1], plain)["metadata"]
    assert meta["solved"] and meta["passed"] == 1


def test_functional_result_cannot_be_printed_by_the_program():
    fake = "```python\nprint('[0, 1]')\nclass Solution:\n    def twoSum(self, n, t):\n        return 0\n```"
    assert step(TWO_SUM, fake)["reward"] == 0.0


def test_hostile_reply_scores_zero_and_env_still_works():
    bomb = "```python\nimport os\nwhile True:\n    os.fork()\n```"
    meta = step(SECOND_LARGEST, bomb)["metadata"]
    assert meta["solved"] is False and meta["status"] == "forbidden"
    loop = step(SECOND_LARGEST, "```python\nwhile True:\n    pass\n```", timeout_s=0.5)
    assert loop["reward"] == 0.0 and loop["metadata"]["status"] == "timeout"
    assert step(SECOND_LARGEST, RIGHT)["reward"] == 1.0


def test_extract_code_prefers_last_python_block():
    reply = "```python\nfirst\n```\ntext\n```\nplain\n```\n```python\nlast\n```\n```text\nnote\n```"
    assert extract_code(reply) == "last"
    assert extract_code("```\nonly plain\n```") == "only plain"
    assert extract_code("```python\n\n```") is None


def test_output_comparison():
    assert outputs_match("3 \n4\n\n", "3\n4")
    assert outputs_match("1.50 2", "1.5 2.0")
    assert not outputs_match("3\n4", "3")
    assert not outputs_match("abc", "abd")


@pytest.mark.parametrize(
    "ground_truth, field",
    [
        ("not json", "lcb.extras.reward_spec.ground_truth"),
        ("[]", "lcb.extras.reward_spec.ground_truth"),
        ('[{"input": 1, "output": "2"}]', "lcb.extras.reward_spec.ground_truth[0].input"),
        ('[{"input": "1", "output": "2", "testtype": "x"}]', "ground_truth[0].testtype"),
        ('[{"input": "1", "output": "2", "testtype": "functional"}]', "metadata.func_name"),
    ],
)
def test_malformed_ground_truth_raises(ground_truth, field):
    with pytest.raises(EnvError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_tests(ground_truth)
    with pytest.raises(EnvError, match="lcb.extras.reward_spec.ground_truth"):
        skyrl_gym.make("lcb", extras={"reward_spec": {"ground_truth": ground_truth}})


def test_missing_reward_spec_and_bad_settings_raise():
    with pytest.raises(EnvError, match="lcb.extras.reward_spec"):
        skyrl_gym.make("lcb", extras={})
    with pytest.raises(EnvError, match="environment.skyrl_gym.lcb.timeout_s"):
        make(SECOND_LARGEST, timeout_s=-1)
