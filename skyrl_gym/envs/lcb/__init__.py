"""LiveCodeBench-style code generation graded in the sandbox (``lcb``)."""

from skyrl_gym.envs.lcb.env import LCBEnv
from skyrl_gym.envs.lcb.grading import extract_code, outputs_match, parse_tests, run_tests

__all__ = ["LCBEnv", "extract_code", "outputs_match", "parse_tests", "run_tests"]
