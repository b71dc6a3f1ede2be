"""Third-party environments arrive through the ``skyrl_gym.envs`` entry-point group."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import skyrl_gym
from skyrl_gym.envs import registration


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[str]:
    """An installed distribution, as pip leaves one: a module and a dist-info folder
    declaring ``plugin_echo = r3_plugin_env:EchoEnv`` in the group."""
    (tmp_path / "r3_plugin_env.py").write_text(
        textwrap.dedent(
            """
            from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

            class EchoEnv(BaseTextEnv):
                def __init__(self, env_config=None, extras={}):
                    super().__init__()
                    self.word = extras.get("word", "hi")

                def step(self, action):
                    reward = float(action == self.word)
                    return BaseTextEnvStepOutput(
                        observations=[], reward=reward, done=True, metadata={}
                    )
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
    registration.reload_entry_points()
    try:
        yield "plugin_echo"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("r3_plugin_env", None)
        skyrl_gym.deregister("plugin_echo")
        registration.reload_entry_points()


def test_an_installed_entry_point_is_registered_and_built(plugin: str) -> None:
    assert plugin in skyrl_gym.registered()
    assert "r3_plugin_env" not in sys.modules  # nothing imported until it is made
    env = skyrl_gym.make(plugin, env_config=None, extras={"word": "yes"})
    env.init([{"role": "user", "content": "say yes"}])
    assert env.step("yes")["reward"] == 1.0
    assert env.spec.id == plugin and env.spec.entry_point == "r3_plugin_env:EchoEnv"


def test_register_wins_over_an_entry_point_of_the_same_name(plugin: str) -> None:
    class Mine(skyrl_gym.Env):
        pass

    skyrl_gym.register(plugin, Mine)  # an entry point alone does not block the id
    assert isinstance(skyrl_gym.make(plugin), Mine)
    with pytest.raises(skyrl_gym.error.RegistrationError, match="expected an id not yet"):
        skyrl_gym.register(plugin, Mine)  # a registered one does, as in SkyRL


def test_a_broken_entry_point_fails_only_when_made_naming_it(tmp_path: Path) -> None:
    info = tmp_path / "r3_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: r3-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[skyrl_gym.envs]\nbroken_env = no_such_mod:Env\n")
    sys.path.insert(0, str(tmp_path))
    registration.reload_entry_points()
    try:
        assert "broken_env" in skyrl_gym.registered()
        with pytest.raises(skyrl_gym.EnvError, match=r"make\('broken_env'\).*no_such_mod:Env"):
            skyrl_gym.make("broken_env")
    finally:
        sys.path.remove(str(tmp_path))
        skyrl_gym.deregister("broken_env")
        registration.reload_entry_points()
