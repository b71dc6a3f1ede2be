"""GSM8K, single-turn (``gsm8k``) and with turn rewards (``gsm8k_multi_turn``)."""

from skyrl_gym.envs.gsm8k.env import INSTRUCTION, GSM8kEnv, gsm8k_prompt
from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

__all__ = ["INSTRUCTION", "GSM8kEnv", "GSM8kMultiTurnEnv", "gsm8k_prompt"]
