"""Tool groups (SkyRL's ``skyrl_gym.tools``): ``core`` defines ``tool`` and
``ToolGroup``."""

from skyrl_gym.tools.core import ToolGroup, tool
from skyrl_gym.tools.python import PythonCodeExecutorToolGroup
from skyrl_gym.tools.search import SearchToolGroup
from skyrl_gym.tools.sql import SQLCodeExecutorToolGroup

__all__ = [
    "PythonCodeExecutorToolGroup",
    "SQLCodeExecutorToolGroup",
    "SearchToolGroup",
    "ToolGroup",
    "tool",
]
