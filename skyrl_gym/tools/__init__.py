"""Tool groups (SkyRL's ``skyrl_gym.tools``): ``core`` defines ``tool`` and
``ToolGroup``."""

from skyrl_gym.tools.core import ToolGroup, tool

__all__ = ["ToolGroup", "tool"]
