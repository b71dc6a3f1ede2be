"""Tools in SkyRL's shape: methods marked ``@tool`` on a ``ToolGroup``.

    class Lookup(ToolGroup):
        def __init__(self): super().__init__(name="Lookup")
        @tool
        def define(self, word): ...

    Lookup().execute_tool("define", "gym")

An environment holds its groups (``BaseTextEnv.init_tool_groups``) and calls
``self._execute_tool(group_name, tool_name, args)``. Tool names are unique across an
environment's groups, as in SkyRL.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from skyrl_gym.error import EnvError


class tool:  # noqa: N801 - SkyRL's name, used as a decorator
    """Marks a ``ToolGroup`` method as a tool; the tool's name is the method's."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.name: str = func.__name__
        self.__doc__ = func.__doc__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self.func, instance)


class ToolGroup:
    """A named set of tools; subclasses mark methods with ``@tool``."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise EnvError(f"ToolGroup.name: expected a non-empty str, got {name!r}")
        self.name = name
        self._tool_registry: dict[str, Callable[..., Any]] = {}
        self._register_tools()

    def _register_tools(self) -> None:
        for klass in reversed(type(self).__mro__):  # a subclass's tool replaces its base's
            for attribute, value in vars(klass).items():
                if isinstance(value, tool):
                    self._tool_registry[value.name] = getattr(self, attribute)

    def get_name(self) -> str:
        return self.name

    def get_tool(self, name: str) -> Callable[..., Any] | None:
        return self._tool_registry.get(name)

    def get_tool_names(self) -> list[str]:
        return list(self._tool_registry)

    def execute_tool(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call tool ``name``; an unknown name raises ``EnvError`` (a ``ValueError``,
        as SkyRL raises), naming the group's tools."""
        func = self._tool_registry.get(name)
        if func is None:
            raise EnvError(
                f"{self.name}.execute_tool.name: expected one of {self.get_tool_names()}, "
                f"got {name!r}"
            )
        return func(*args, **kwargs)

    def get_tool_to_group_mapping(self) -> dict[str, str]:
        return dict.fromkeys(self._tool_registry, self.name)
