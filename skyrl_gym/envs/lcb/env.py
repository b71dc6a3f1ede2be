"""LiveCodeBench-style code generation (SkyRL's ``lcb``), single turn.

The reply's program (its last ```python block) runs in the sandbox on the row's
tests (``reward_spec["ground_truth"]``, see ``grading``). Reward 1.0 when every
test passes, else 0.0; a reply without code scores 0.0.

Settings (``environment.skyrl_gym.lcb``): ``timeout_s`` (6, per test: wall clock,
and CPU rounded up), ``memory_mb`` (1024), ``output_kb`` (1024, per stream).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from skyrl_gym.core import action_text
from skyrl_gym.envs._checks import check_settings, extra, number_setting
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.lcb.grading import FIELD, extract_code, parse_tests, run_tests
from skyrl_gym.error import EnvError
from skyrl_gym.sandbox import SandboxLimits

NAME = "lcb"


def lcb_limits(env_config: Any) -> SandboxLimits:
    """The sandbox limits for one test, from the env's settings."""
    check_settings(env_config, NAME, ("timeout_s", "memory_mb", "output_kb"))
    timeout = number_setting(env_config, NAME, "timeout_s", 6.0, low=0.1, high=600)
    memory_mb = number_setting(env_config, NAME, "memory_mb", 1024, low=64, high=1 << 20)
    output_kb = number_setting(env_config, NAME, "output_kb", 1024, low=1, high=1 << 20)
    return SandboxLimits(
        wall_s=timeout,
        cpu_s=max(1, math.ceil(timeout)),
        memory_bytes=int(memory_mb) << 20,
        output_bytes=int(output_kb) << 10,
    )


class LCBEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        spec = extra(extras, NAME, "reward_spec")
        if not isinstance(spec, Mapping) or spec.get("ground_truth") is None:
            raise EnvError(f"{FIELD}: expected the tests, got reward_spec={spec!r:.80}")
        self.tests, self.func_name = parse_tests(spec["ground_truth"])
        self.limits = lcb_limits(env_config)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        begin_turn(self, NAME)
        code = extract_code(action_text(action))
        metadata: dict[str, Any] = {"parsed_code": code, "total": len(self.tests), "passed": 0}
        if code is None:
            metadata.update(solved=False, failure="no_code", status=None)
        else:
            outcome = run_tests(code, self.tests, self.func_name, self.limits)
            metadata.update(
                passed=outcome.passed,
                solved=outcome.failure is None,
                failure=outcome.failure,
                status=outcome.status,
            )
        reward = 1.0 if metadata["solved"] else 0.0
        return end_turn(self, observations=[], reward=reward, done=True, metadata=metadata)
