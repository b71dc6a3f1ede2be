"""SkyRL's text environment: a chat in, a reply out, tools and several turns optional.

A subclass implements ``step(action) -> BaseTextEnvStepOutput`` and is built as
``Cls(env_config, extras)``: ``env_config`` is the ``environment.skyrl_gym.<id>``
node of the run's config (settings shared by every episode), ``extras`` the dataset
row's fields (``reward_spec``, ``extra_info``, ``max_turns``, ...). Writing one:
``docs/environments.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict

from skyrl_gym.core import Env
from skyrl_gym.error import EnvError
from skyrl_gym.tools.core import ToolGroup

MessageType = dict[str, str]
ConversationType = list[MessageType]


class BaseTextEnvStepOutput(TypedDict):
    """What ``step`` returns (a plain dict; SkyRL's keys)."""

    observations: ConversationType
    """Messages to append to the chat before the next turn; empty when ``done``."""
    reward: float
    """This turn's reward; the trajectory's is the sum over turns."""
    done: bool
    metadata: dict[str, Any]
    """Anything to report; ``solved`` (bool) feeds ``reward/success_rate``."""
    postprocessed_action: NotRequired[str | None]
    """When set, the text that stands for the reply in the chat from now on (the
    sampled tokens still train); None keeps the reply as generated."""


class BaseTextEnv(Env[ConversationType, str]):
    """Text in, text out. ``turns`` counts steps taken, ``max_turns`` bounds them."""

    def __init__(self) -> None:
        super().__init__()
        self.turns = 0
        self.max_turns = 1
        self.tool_groups: list[ToolGroup] = []
        self.tool_to_toolgroup: dict[str, str] = {}

    def init_tool_groups(self, tool_groups: Sequence[ToolGroup] = ()) -> None:
        """Hold ``tool_groups``; a tool name offered by two groups is refused."""
        self.tool_groups = list(tool_groups)
        self.tool_to_toolgroup = {}
        for group in self.tool_groups:
            for name, owner in group.get_tool_to_group_mapping().items():
                if name in self.tool_to_toolgroup:
                    raise EnvError(
                        f"{type(self).__name__}.init_tool_groups: expected unique tool names, "
                        f"got {name!r} in {self.tool_to_toolgroup[name]!r} and {owner!r}"
                    )
                self.tool_to_toolgroup[name] = owner

    def _execute_tool(self, tool_group_name: str, tool_name: str, tool_input: Any) -> Any:
        """Run ``tool_name`` of group ``tool_group_name`` with ``*tool_input`` (a tuple
        or list of positional arguments, SkyRL's convention)."""
        for group in self.tool_groups:
            if group.name == tool_group_name:
                return group.execute_tool(tool_name, *tool_input)
        raise EnvError(
            f"{type(self).__name__}._execute_tool.tool_group_name: expected one of "
            f"{[g.name for g in self.tool_groups]}, got {tool_group_name!r}"
        )

    def step(self, action: str) -> BaseTextEnvStepOutput:
        raise NotImplementedError(f"{type(self).__name__}.step")

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """The messages to render first, and optional metadata; the prompt as given."""
        return prompt, {}

    def close(self) -> None:
        """Override to release what the environment holds."""

    def get_metrics(self) -> dict[str, Any]:
        """This episode's own metrics (none by default); see ``aggregate_metrics``."""
        return {}

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        """Many episodes' ``get_metrics`` in one dict: numbers averaged, others dropped."""
        from skyrl_gym.metrics import default_aggregate_metrics

        return default_aggregate_metrics(metrics)
