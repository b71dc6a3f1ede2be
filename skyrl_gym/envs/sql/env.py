"""Text-to-SQL over several turns (SkyRL's ``text2sql``).

Each turn the model either runs a query, ``<sql>SELECT ...</sql>``, and reads its rows
in an ``<observation>`` (with a reminder of the turns left), or answers with
``<solution>SELECT ...</solution>``, which ends the episode. The episode also ends when
the turns run out. Intermediate turns score 0; the last one scores the whole chat with
``utils.compute_score_single``: -1.0 malformed, 1.0 when the solution returns the gold
SQL's rows, else 0.0. Every query, the model's and the gold one, runs read-only and
time- and row-bounded (``skyrl_gym/tools/sql.py``).

Row fields (``extras``): ``db_id``, ``reward_spec.ground_truth`` (the gold SQL),
``data`` (which collection: ``spider``, ``synsql``, ``bird`` as SkyRL lays them out
under ``db_path``, or ``local``: ``<db_path>/<db_id>/<db_id>.sqlite``, what
``skyrl_gym/envs/sql/local_db.py`` and ``scripts/make_sql_dataset.py`` write), and
``max_turns`` (default 5).

Settings (``environment.skyrl_gym.text2sql``): ``db_path``, the root folder of the
databases; default ``~/.cache/skyrl_gym/sql_data`` (SkyRL's is
``/home/ray/default/sql_data``), where ``scripts/make_sql_dataset.py`` writes by
default, so the two agree with no setting. ``timeout`` (5 s per tool query),
``score_timeout`` (30 s per scoring query), ``max_rows`` and ``max_chars`` (what one
observation shows, 50 rows and 2000 characters). The database file must exist when
the environment is built: a missing one raises ``DatabaseNotFoundError`` naming it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from skyrl_gym.core import action_text
from skyrl_gym.envs._checks import (
    check_int,
    check_settings,
    config_value,
    extra,
    int_setting,
    number_setting,
    setting_path,
)
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
from skyrl_gym.envs.sql.utils import (
    SCORE_TIMEOUT,
    SOLUTION_CLOSE,
    SOLUTION_OPEN,
    compute_score_single,
)
from skyrl_gym.error import EnvError
from skyrl_gym.tools.sql import DEFAULT_TIMEOUT, SQLCodeExecutorToolGroup, check_db_id

NAME = "text2sql"
DEFAULT_DB_PATH = os.path.join("~", ".cache", "skyrl_gym", "sql_data")
COLLECTIONS = {
    "spider": "spider/database",
    "synsql": "SynSQL-2.5M/databases",
    "bird": "bird/train/train_databases",
    "local": "",
}
"""``extras.data`` -> the folder under ``db_path`` holding ``<db_id>/<db_id>.sqlite``."""
SQL_OPEN, SQL_CLOSE = "<sql>", "</sql>"


class DatabaseNotFoundError(EnvError, FileNotFoundError):
    """A row's database file is missing (a ``FileNotFoundError`` too, as SkyRL raises)."""


@dataclass
class Text2SQLEnvConfig:
    """The settings as a typed object (a dict or an OmegaConf node works as well)."""

    db_path: str = DEFAULT_DB_PATH
    timeout: float = 5.0
    score_timeout: float = SCORE_TIMEOUT
    max_rows: int = 50
    max_chars: int = 2000


def find_sql(text: str) -> str | None:
    """The text inside the first complete ``<sql>...</sql>``, unstripped, or None.

    ``str.find`` rather than a lazy regex, which would rescan the tail once for each
    unclosed ``<sql>`` in a long reply."""
    start = text.find(SQL_OPEN)
    if start < 0:
        return None
    end = text.find(SQL_CLOSE, start + len(SQL_OPEN))
    return None if end < 0 else text[start + len(SQL_OPEN) : end]


class SQLEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.db_id = check_db_id(f"{NAME}.extras.db_id", extra(extras, NAME, "db_id"))
        spec = extra(extras, NAME, "reward_spec")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("ground_truth"), str):
            raise EnvError(
                f"{NAME}.extras.reward_spec.ground_truth: expected the gold SQL as a str, "
                f"got {spec!r:.120}"
            )
        self.gold_sql: str = spec["ground_truth"]
        self.task = extra(extras, NAME, "data")
        if self.task not in COLLECTIONS:
            raise EnvError(
                f"{NAME}.extras.data: expected one of {sorted(COLLECTIONS)}, got {self.task!r}"
            )
        self.max_turns = check_int(
            f"{NAME}.extras.max_turns", (extras or {}).get("max_turns", 5), low=1, high=10_000
        )
        check_settings(
            env_config, NAME, ("db_path", "timeout", "score_timeout", "max_rows", "max_chars")
        )
        root = config_value(env_config, NAME, "db_path", DEFAULT_DB_PATH)
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise EnvError(f"{setting_path(NAME, 'db_path')}: expected a folder, got {root!r}")
        self.db_path = os.path.join(os.path.expanduser(str(root)), COLLECTIONS[self.task])
        self.score_timeout = number_setting(
            env_config, NAME, "score_timeout", SCORE_TIMEOUT, low=0.01, high=600
        )
        self.tool_group = SQLCodeExecutorToolGroup(
            self.db_path,
            max_rows=int_setting(env_config, NAME, "max_rows", 50, low=1, high=1_000_000),
            max_chars=int_setting(env_config, NAME, "max_chars", 2000, low=1, high=1_000_000),
            timeout=number_setting(
                env_config, NAME, "timeout", DEFAULT_TIMEOUT, low=0.01, high=600
            ),
        )
        self.db_file = self.tool_group.db_file(self.db_id)
        if not os.path.exists(self.db_file):
            raise DatabaseNotFoundError(
                f"{NAME}.db_file: expected a database at {self.db_file} (from "
                f"{setting_path(NAME, 'db_path')}={str(root)!r}, extras.data={self.task!r}, "
                f"extras.db_id={self.db_id!r}), got no such file"
            )
        self.init_tool_groups([self.tool_group])
        self.chat_history: ConversationType = []
        """Every reply and observation so far; the final reward scores them joined."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        begin_turn(self, NAME)
        text = action_text(action)
        self.chat_history.append({"role": "assistant", "content": text})
        if self.turns >= self.max_turns or (SOLUTION_OPEN in text and SOLUTION_CLOSE in text):
            reward = compute_score_single(
                "".join(m["content"] for m in self.chat_history),
                self.gold_sql,
                self.db_file,
                timeout=self.score_timeout,
            )
            return end_turn(
                self,
                observations=[],
                reward=reward,
                done=True,
                metadata={"solved": reward == 1.0, "well_formed": reward != -1.0},
            )
        tool_input = (self.db_id, find_sql(text), self.max_turns - self.turns)
        observation = self._execute_tool(self.tool_group.name, "sql", tool_input)
        message = {"role": "user", "content": observation}
        self.chat_history.append(message)
        return end_turn(
            self,
            observations=[message],
            reward=0.0,
            done=False,
            metadata={
                "tool_group": self.tool_group.name,
                "tool_name": "sql",
                "tool_input": tool_input,
                "solved": False,
            },
        )
