"""Question answering with a search engine over several turns (SkyRL's ``search``,
Search-R1's recipe).

Each turn the model either searches, ``<search>query</search>``, and reads the top
passages in ``<information>{"result": "Doc 1: ..."}</information>``, or answers,
``<answer>...</answer>``, which ends the episode; so does running out of turns.
Intermediate turns score 0; the last one scores 1.0 when its last answer matches one
of ``reward_spec.ground_truth["target"]`` after normalization (``utils.em_check``),
else 0.0. A reply with neither tag gets an empty ``<information></information>``,
and a search that fails (server down, timeout, garbage) gets the error in its place:
the model's episode goes on, nothing raises.

Only the final reply is scored. (SkyRL scores the whole chat joined, retrieved
passages included; the two differ only when a passage itself holds an ``<answer>``
tag, which should not count as the model's answer.)

Row fields (``extras``): ``reward_spec.ground_truth.target`` (a str or a list of
accepted answers) and ``max_turns`` (default 2, SkyRL's).

Settings (``environment.skyrl_gym.search``): ``search_url`` (SkyRL's retrieval
server, default ``http://127.0.0.1:8000/retrieve``, or ``local``: search in this
process over ``corpus_path``, a JSONL corpus, or the built-in demo corpus when that
is unset; see ``local_retriever.py``), ``topk`` (3 passages), ``timeout`` (30 s per
request), ``retries`` (2, after the first attempt), ``log_requests`` (False).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from skyrl_gym.core import action_text
from skyrl_gym.envs._checks import (
    bool_setting,
    check_int,
    check_settings,
    config_value,
    int_setting,
    setting_path,
)
from skyrl_gym.envs._turns import begin_turn, end_turn
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
from skyrl_gym.envs.search.local_retriever import index_for
from skyrl_gym.envs.search.utils import ANSWER_CLOSE, ANSWER_OPEN, compute_score
from skyrl_gym.error import EnvError
from skyrl_gym.tools import search as search_tool
from skyrl_gym.tools.search import SearchToolGroup

logger = logging.getLogger(__name__)

NAME = "search"
SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
SETTINGS = ("search_url", "topk", "timeout", "retries", "log_requests", "corpus_path")


class MissingGroundTruthError(EnvError, AssertionError):
    """A row without ``reward_spec.ground_truth``; an ``AssertionError`` too, which
    SkyRL raises for it."""


@dataclass
class SearchEnvConfig:
    """The settings as a typed object (a dict or an OmegaConf node works as well)."""

    search_url: str = search_tool.DEFAULT_URL
    topk: int = 3
    timeout: float = search_tool.DEFAULT_TIMEOUT
    retries: int = search_tool.DEFAULT_RETRIES
    log_requests: bool = False
    corpus_path: str | None = None


def _ground_truth(extras: Any) -> tuple[Mapping[str, Any], tuple[str, ...]]:
    """The row's ``ground_truth`` as given, and its targets as strings."""
    spec = extras.get("reward_spec") if isinstance(extras, Mapping) else None
    if not isinstance(spec, Mapping):
        raise MissingGroundTruthError(
            f"{NAME}.extras.reward_spec: expected a mapping holding ground_truth, got "
            f"{spec!r:.80} (reward_spec field is required)"
        )
    truth = spec.get("ground_truth")
    field = f"{NAME}.extras.reward_spec.ground_truth"
    if truth is None:
        raise MissingGroundTruthError(
            f"{field}: expected {{'target': answers}}, got none "
            "(ground_truth is required in reward_spec field)"
        )
    target: Any = truth.get("target") if isinstance(truth, Mapping) else None
    if hasattr(target, "tolist"):  # a numpy array, as pandas reads a parquet list
        target = target.tolist()
    if isinstance(target, str):
        target = [target]
    targets = tuple(target) if isinstance(target, (list, tuple)) else ()
    if not targets or not all(isinstance(t, str) for t in targets):
        raise MissingGroundTruthError(
            f"{field}.target: expected a str or a non-empty list of str, got {truth!r:.120}"
        )
    return truth, targets


def _tool_group(env_config: Any) -> SearchToolGroup:
    check_settings(env_config, NAME, SETTINGS)

    def setting(key: str, default: Any) -> Any:
        return config_value(env_config, NAME, key, default)

    url = search_tool.check_search_url(
        setting_path(NAME, "search_url"), setting("search_url", search_tool.DEFAULT_URL)
    )
    corpus_path = setting("corpus_path", None)
    if corpus_path is not None and (url != search_tool.LOCAL or not isinstance(corpus_path, str)):
        raise EnvError(
            f"{setting_path(NAME, 'corpus_path')}: expected a JSONL path with search_url "
            f"{search_tool.LOCAL!r}, got {corpus_path!r} with search_url {url!r}"
        )
    log_requests = bool_setting(env_config, NAME, "log_requests", False)
    retriever = None
    if url == search_tool.LOCAL:
        try:
            retriever = index_for(corpus_path)
        except EnvError as exc:
            raise EnvError(f"{setting_path(NAME, 'corpus_path')}: {exc}") from exc
    return SearchToolGroup(
        url,
        topk=int_setting(env_config, NAME, "topk", 3, low=1, high=100),
        timeout=search_tool.check_seconds(
            setting_path(NAME, "timeout"), setting("timeout", search_tool.DEFAULT_TIMEOUT)
        ),
        retries=int_setting(
            env_config, NAME, "retries", search_tool.DEFAULT_RETRIES, low=0, high=20
        ),
        log_requests=log_requests,
        retriever=retriever,
    )


class SearchEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.ground_truth, self.targets = _ground_truth(extras)
        self.max_turns = check_int(
            f"{NAME}.extras.max_turns", (extras or {}).get("max_turns", 2), low=1, high=64
        )
        self.tool_group = _tool_group(env_config)
        self.init_tool_groups([self.tool_group])
        self.chat_history: ConversationType = []
        """Every reply and observation so far."""

    def _parse_action(self, action: str) -> list[str | None]:
        """``[query]``: the text of the first complete ``<search>...</search>``,
        unstripped, or None."""
        start = action.find(SEARCH_OPEN)
        end = action.find(SEARCH_CLOSE, start + len(SEARCH_OPEN)) if start >= 0 else -1
        return [None if end < 0 else action[start + len(SEARCH_OPEN) : end]]

    def _is_done(self, action: str) -> bool:
        return self.turns >= self.max_turns or (ANSWER_OPEN in action and ANSWER_CLOSE in action)

    def _get_reward(self, action: str, done: bool) -> float:
        if not done:
            return 0.0
        return compute_score(action, {"target": list(self.targets)})

    def _execute_tool(self, tool_group_name: str, tool_name: str, tool_input: Any) -> str:
        return (
            "\n<information>"
            + super()._execute_tool(tool_group_name, tool_name, tool_input)
            + "</information>\n"
        )

    def step(self, action: str) -> BaseTextEnvStepOutput:
        begin_turn(self, NAME)
        text = action_text(action)
        self.chat_history.append({"role": "assistant", "content": text})
        if self._is_done(text):
            reward = self._get_reward(text, True)
            return end_turn(
                self, observations=[], reward=reward, done=True, metadata={"solved": reward == 1.0}
            )
        query = self._parse_action(text)
        try:
            observation = self._execute_tool(self.tool_group.name, "search", query)
        except Exception as exc:  # a tool bug must not end the run; logged, then shown
            logger.exception("search tool failed on %r", query)
            error = json.dumps({"result": f"Search error: {type(exc).__name__}: {exc}"})
            observation = f"\n<information>{error}</information>\n"
        message = {"role": "user", "content": observation}
        self.chat_history.append(message)
        metadata = {
            "tool_group": self.tool_group.name,
            "tool_name": "search",
            "tool_input": query,
            "solved": False,
        }
        return end_turn(self, observations=[message], reward=0.0, done=False, metadata=metadata)
