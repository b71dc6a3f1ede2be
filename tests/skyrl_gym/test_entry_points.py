"""Third-party environments arrive through the ``skyrl_gym.envs`` entry-point group."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyrl_gym
from skyrl_gym import registry


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[str]:
    """An installed distribution, as pip leaves one: a module and a dist-info folder
    declaring ``plugin_echo = r3_plugin_env:EchoEnv`` in the group."""
    (tmp_path / "r3_plugin_env.py").write_text(
        textwrap.dedent(
            """
            from skyrl_gym import Env, StepOutput

            class EchoEnv(Env):
                name = "plugin_echo"

                def __init__(self, *, word: str = "hi") -> None:
                    super().__init__()
                    self.word = word

                def _step(self, action, turn):
                    return StepOutput([], float(action == self.word), True)
            """
        )
    )
    info = tmp_path / "r3_plugin_env-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: r3-plugin-env\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[skyrl_gym.envs]\nplugin_echo = r3_plugin_env:EchoEnv\n"
    )
    sys.path.insert(0, str(tmp_path))
    registry.reload_entry_points()
    try:
        yield "plugin_echo"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("r3_plugin_env", None)
        skyrl_gym.unregister("plugin_echo")
        registry.reload_entry_points()


def test_an_installed_entry_point_is_registered_and_built(plugin: str) -> None:
    assert plugin in skyrl_gym.registered()
    assert "r3_plugin_env" not in sys.modules  # nothing imported until it is made
    env = skyrl_gym.make(plugin, word="yes")
    env.init([{"role": "user", "content": "say yes"}])
    assert env.step("yes").reward == 1.0


def test_register_wins_over_an_entry_point_of_the_same_name(plugin: str) -> None:
    class Mine(skyrl_gym.Env):
        def _step(self, action, turn):  # pragma: no cover - never stepped here
            raise AssertionError

    with pytest.warns(UserWarning, match="replacing environment 'plugin_echo'"):
        skyrl_gym.register(plugin, Mine)
    assert isinstance(skyrl_gym.make(plugin), Mine)
