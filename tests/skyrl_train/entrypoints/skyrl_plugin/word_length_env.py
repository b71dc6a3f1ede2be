# ruff: noqa: UP006, UP035, B006 - written as SkyRL users write (typing.Dict, extras={})
"""An environment file as a SkyRL user writes it for skyrl-gym 0.4.0: only SkyRL's
import paths, its constructor signature, ``env_config`` read by attribute, a
``ToolGroup`` called through ``_execute_tool``, the step output as a
``BaseTextEnvStepOutput`` dict, ``postprocessed_action`` and the metrics hooks.
The launch test registers it through the ``skyrl_gym.envs`` entry-point group and
trains on it unchanged."""

import re
from typing import Any, Dict

from omegaconf import DictConfig

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.tools.core import ToolGroup, tool


class LengthToolGroup(ToolGroup):
    def __init__(self):
        super().__init__(name="LengthToolGroup")

    @tool
    def length(self, word: str) -> str:
        return f"<result>{len(word)}</result>"


class WordLengthEnv(BaseTextEnv):
    """Asks for a word's length: ``<len>word</len>`` calls the tool, ``<answer>N</answer>``
    ends the episode (reward 1 when right, ``env_config.format_bonus`` when answered)."""

    def __init__(self, env_config: DictConfig, extras: Dict[str, Any] = {}):
        super().__init__()
        assert "reward_spec" in extras, "reward_spec field is required"
        self.ground_truth = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = extras["max_turns"] if "max_turns" in extras else 3
        self.format_bonus = float(env_config.format_bonus) if "format_bonus" in env_config else 0.0
        self.tool_group = LengthToolGroup()
        self.init_tool_groups([self.tool_group])
        self.tool_calls = 0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        answer = re.search(r"<answer>(.*?)</answer>", action, re.DOTALL)
        if answer is not None or self.turns >= self.max_turns:
            right = answer is not None and answer.group(1).strip() == self.ground_truth
            reward = 1.0 if right else (self.format_bonus if answer is not None else 0.0)
            return BaseTextEnvStepOutput(
                observations=[], reward=reward, done=True, metadata={"solved": right}
            )
        call = re.search(r"<len>(.*?)</len>", action, re.DOTALL)
        if call is None:
            observation = "Call <len>word</len> or answer with <answer>N</answer>."
            return BaseTextEnvStepOutput(
                observations=[{"role": "user", "content": observation}],
                reward=0.0,
                done=False,
                metadata={"solved": False},
            )
        self.tool_calls += 1
        output = self._execute_tool("LengthToolGroup", "length", [call.group(1)])
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": output}],
            reward=0.0,
            done=False,
            metadata={"solved": False},
            # Whatever followed the tool call is dropped from the conversation.
            postprocessed_action=action[: call.end()],
        )

    def get_metrics(self) -> Dict[str, Any]:
        return {"tool_calls": self.tool_calls, "turns": self.turns}
