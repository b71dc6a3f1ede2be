"""Text environments for multi-turn RL: an ``init``/``step`` API, a registry, datasets.

env = skyrl_gym.make("guess_number", target=7)
prompt, info = env.init(prompt)
out = env.step("5")        # StepOutput(observations, reward, done, metadata)
"""

from skyrl_gym.core import Env, Message, StepOutput, Task, action_text, first_char
from skyrl_gym.envs import (
    CalculatorEnv,
    Gsm8kEnv,
    GuessNumberEnv,
    RepeatLetterEnv,
    SingleDigitSumEnv,
)
from skyrl_gym.errors import EnvError
from skyrl_gym.registry import make, make_dataset, register, registered, unregister

register("calculator", CalculatorEnv)
register("gsm8k", Gsm8kEnv)
register("guess_number", GuessNumberEnv)
register("repeat_letter", RepeatLetterEnv)
register("single_digit_sum", SingleDigitSumEnv)

__all__ = [
    "CalculatorEnv",
    "Env",
    "EnvError",
    "Gsm8kEnv",
    "GuessNumberEnv",
    "Message",
    "RepeatLetterEnv",
    "SingleDigitSumEnv",
    "StepOutput",
    "Task",
    "action_text",
    "first_char",
    "make",
    "make_dataset",
    "register",
    "registered",
    "unregister",
]
