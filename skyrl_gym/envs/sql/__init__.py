"""Text-to-SQL (``text2sql``): the environment, its scoring, and a small local database."""

from skyrl_gym.envs.sql.env import DatabaseNotFoundError, SQLEnv, Text2SQLEnvConfig
from skyrl_gym.envs.sql.utils import compute_score_single, verify_format_and_extract

__all__ = [
    "DatabaseNotFoundError",
    "SQLEnv",
    "Text2SQLEnvConfig",
    "compute_score_single",
    "verify_format_and_extract",
]
