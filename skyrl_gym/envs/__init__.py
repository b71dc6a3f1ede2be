"""Built-in text environments, small enough for a random byte-level model to score on."""

from skyrl_gym.envs.calculator import CalculatorEnv
from skyrl_gym.envs.digit_sum import SingleDigitSumEnv
from skyrl_gym.envs.gsm8k import Gsm8kEnv
from skyrl_gym.envs.guess_number import GuessNumberEnv
from skyrl_gym.envs.repeat_letter import RepeatLetterEnv

__all__ = [
    "CalculatorEnv",
    "Gsm8kEnv",
    "GuessNumberEnv",
    "RepeatLetterEnv",
    "SingleDigitSumEnv",
]
