"""The environments this package registers: SkyRL's that need nothing from outside
(``gsm8k``, ``gsm8k_multi_turn``, ``aime``, ``text2sql``, ``lcb``, and ``search`` with a
local retriever) and this project's
small ones a random byte-level model can score on (``docs/environments.md``)."""

from skyrl_gym.envs.registration import deregister, register, registry

_BUILT_IN = {
    "aime": "skyrl_gym.envs.aime.env:AIMEEnv",
    "calculator": "skyrl_gym.envs.calculator:CalculatorEnv",
    "gsm8k": "skyrl_gym.envs.gsm8k.env:GSM8kEnv",
    "gsm8k_multi_turn": "skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv",
    "guess_number": "skyrl_gym.envs.guess_number:GuessNumberEnv",
    "lcb": "skyrl_gym.envs.lcb.env:LCBEnv",
    "repeat_letter": "skyrl_gym.envs.repeat_letter:RepeatLetterEnv",
    "search": "skyrl_gym.envs.search.env:SearchEnv",
    "single_digit_sum": "skyrl_gym.envs.digit_sum:SingleDigitSumEnv",
    "text2sql": "skyrl_gym.envs.sql.env:SQLEnv",
}
for _id, _entry in _BUILT_IN.items():
    if _id not in registry:  # a re-import (importlib.reload) must not raise
        register(id=_id, entry_point=_entry)

__all__ = ["deregister", "register", "registry"]
