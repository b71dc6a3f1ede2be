"""skyrl_gym's SkyRL-compatible API (register/make/spec, tools, BaseTextEnv) and what
this package adds (checked step outputs, task environments, generated datasets)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from omegaconf import DictConfig

import skyrl_gym
from skyrl_gym import EnvError, EnvSpec, error
from skyrl_gym.envs.base_text_env import BaseTextEnv
from skyrl_gym.tools.core import ToolGroup, tool

HERE = __name__


class Echo(BaseTextEnv):
    def __init__(self, env_config=None, extras=None, *, size: int = 1, tag: str = "") -> None:
        super().__init__()
        self.env_config, self.extras, self.size, self.tag = env_config, extras, size, tag
        self.closed = 0

    def close(self) -> None:
        self.closed += 1

    @classmethod
    def create(cls, **kwargs) -> Echo:
        return cls(tag="created", **kwargs)


NOT_CALLABLE = "a string"


@pytest.fixture
def ids():
    """Ids a test registers, deregistered afterwards."""
    made: list[str] = []
    yield made
    for env_id in made:
        skyrl_gym.registry.pop(env_id, None)


def reg(ids, env_id, entry_point, **kwargs):
    ids.append(env_id)
    skyrl_gym.register(id=env_id, entry_point=entry_point, kwargs=kwargs or None)


@pytest.mark.parametrize("entry", [Echo, f"{HERE}:Echo"])
def test_make_merges_spec_kwargs_with_call_kwargs_and_sets_spec(ids, entry) -> None:
    reg(ids, "t_echo", entry, size=2, tag="spec")
    env = skyrl_gym.make("t_echo", tag="call", extras={"a": 1})
    assert isinstance(env, Echo) and (env.size, env.tag, env.extras) == (2, "call", {"a": 1})
    assert env.spec == EnvSpec(
        id="t_echo", entry_point=entry, kwargs={"size": 2, "tag": "call", "extras": {"a": 1}}
    )
    assert skyrl_gym.spec("t_echo").kwargs == {"size": 2, "tag": "spec"}  # not mutated
    assert isinstance(skyrl_gym.registry["t_echo"], EnvSpec)
    assert "t_echo" in skyrl_gym.registered()


def test_make_from_an_envspec_and_spec_make() -> None:
    direct = EnvSpec(id="unregistered", entry_point=f"{HERE}:Echo", kwargs={"size": 3})
    env = skyrl_gym.make(direct, size=4)
    assert env.size == 4 and env.spec.id == "unregistered" and direct.name == "unregistered"
    assert direct.make().size == 3 and direct.kwargs == {"size": 3}
    assert skyrl_gym.Env.spec is None  # the class attribute stays unset


def test_duplicate_register_raises_and_deregister_removes(ids) -> None:
    reg(ids, "t_dup", Echo)
    with pytest.raises(error.RegistrationError, match=r"register.id: .*got 't_dup'.*deregister"):
        skyrl_gym.register(id="t_dup", entry_point=Echo)
    skyrl_gym.deregister("t_dup")
    assert "t_dup" not in skyrl_gym.registry
    with pytest.raises(EnvError, match=r"deregister.id: expected one of \[.*'gsm8k'.*got 't_dup'"):
        skyrl_gym.deregister("t_dup")
    assert skyrl_gym.unregister is skyrl_gym.deregister


def test_pprint_registry_lists_ids_in_columns(capsys) -> None:
    text = skyrl_gym.pprint_registry({"a": 1, "bb": 2, "ccc": 3, "d": 4}, disable_print=True)
    assert text.splitlines() == ["a    bb   ccc", "d"]
    assert skyrl_gym.pprint_registry({}, disable_print=True) == "No environments registered."
    full = skyrl_gym.pprint_registry(num_cols=2, disable_print=True)
    assert {"gsm8k", "gsm8k_multi_turn", "text2sql"} <= set(full.split())
    assert all(len(line.split()) <= 2 for line in full.splitlines())
    assert skyrl_gym.pprint_registry({"x": 1}) is None and capsys.readouterr().out == "x\n"


@pytest.mark.parametrize(
    ("entry_point", "kwargs", "match"),
    [
        ("no_colon", None, r"register\('t_bad'\).entry_point: expected 'module:attribute'"),
        (":Echo", None, r"entry_point: expected 'module:attribute'.*got ':Echo'"),
        (42, None, r"register\('t_bad'\).entry_point: .*got 42"),
        (Echo, [("size", 1)], r"register\('t_bad'\).kwargs: expected a dict"),
    ],
)
def test_bad_registrations_name_the_field(entry_point, kwargs, match) -> None:
    with pytest.raises(error.RegistrationError, match=match):
        skyrl_gym.register(id="t_bad", entry_point=entry_point, kwargs=kwargs)
    assert "t_bad" not in skyrl_gym.registry
    with pytest.raises(error.RegistrationError, match=r"register.id: expected a non-empty str"):
        skyrl_gym.register(id="", entry_point=Echo)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (f"{HERE}:Missing", r"make\('t_ep'\): entry point .*:Missing': cannot import.*Missing"),
        ("no_such_module_xyz:Env", r"cannot import it \(No module named 'no_such_module_xyz'"),
        (f"{HERE}:NOT_CALLABLE", r"make\('t_ep'\): .*expected a callable .*got str"),
    ],
)
def test_a_string_entry_point_fails_at_make_naming_it(ids, entry, match) -> None:
    reg(ids, "t_ep", entry)  # registering imports nothing
    with pytest.raises(EnvError, match=match):
        skyrl_gym.make("t_ep")
    with pytest.raises(EnvError, match=r"make\('t_ep'\): entry point"):
        skyrl_gym.make(EnvSpec(id="t_ep", entry_point=entry))


def test_a_dotted_entry_point_attribute_resolves(ids) -> None:
    reg(ids, "t_dotted", f"{HERE}:Echo.create")
    assert skyrl_gym.make("t_dotted", size=5).tag == "created"


def test_make_refuses_kwargs_the_factory_does_not_take_and_non_envs(ids) -> None:
    reg(ids, "t_kw", Echo, colour="red")
    with pytest.raises(error.EnvTypeError, match=r"make\('t_kw'\).kwargs: .*'size', 'tag'.*colour"):
        skyrl_gym.make("t_kw")
    with pytest.raises(TypeError):
        skyrl_gym.make("gsm8k", foo=1)
    reg(ids, "t_dict", lambda **kwargs: {"kwargs": kwargs})
    with pytest.raises(
        error.EnvTypeError, match=r"make\('t_dict'\): expected a skyrl_gym.Env.*dict"
    ):
        skyrl_gym.make("t_dict", x=1)


def test_an_unknown_id_raises_skyrl_error_naming_the_known() -> None:
    for call in (skyrl_gym.make, skyrl_gym.spec):
        with pytest.raises(error.Error) as info:
            call("no_such_env")
        assert isinstance(info.value, EnvError) and isinstance(info.value, ValueError)
        assert "'gsm8k'" in str(info.value) and "'no_such_env'" in str(info.value)


class Maths(ToolGroup):
    def __init__(self, name: str = "Maths") -> None:
        super().__init__(name=name)

    @tool
    def add(self, a, b=0):
        return a + b

    @tool
    def neg(self, a):
        return -a

    def helper(self):  # not a tool
        return None


class MoreMaths(Maths):
    @tool
    def add(self, a, b=0):  # overrides the base's tool
        return f"{a}+{b}"

    @tool
    def double(self, a):
        return 2 * a


class Doubler(ToolGroup):
    @tool
    def double(self, a):
        return 2 * a


def test_tool_groups_find_marked_methods_including_inherited() -> None:
    group = MoreMaths(name="M")
    assert sorted(group.get_tool_names()) == ["add", "double", "neg"]
    assert group.get_name() == "M" and group.get_tool("helper") is None
    assert group.execute_tool("add", 1, b=2) == "1+2" and group.execute_tool("neg", 3) == -3
    assert Maths().execute_tool("add", 1, 2) == 3 and group.get_tool("double")(4) == 8
    assert group.get_tool_to_group_mapping() == {"add": "M", "double": "M", "neg": "M"}
    with pytest.raises(
        ValueError, match=r"M.execute_tool.name: expected one of .*'add'.*got 'mul'"
    ):
        group.execute_tool("mul", 1)
    with pytest.raises(EnvError, match=r"ToolGroup.name: expected a non-empty str"):
        Maths(name="")


def test_base_text_env_tool_groups_and_execute_tool() -> None:
    env = Echo()
    env.init_tool_groups([Maths(), Doubler(name="Other")])
    assert env.tool_to_toolgroup == {"add": "Maths", "neg": "Maths", "double": "Other"}
    assert env._execute_tool("Maths", "add", (2, 3)) == 5
    assert env._execute_tool("Other", "double", [5]) == 10
    with pytest.raises(EnvError, match=r"tool_group_name: expected one of \['Maths', 'Other'\]"):
        env._execute_tool("Nope", "add", (1,))
    with pytest.raises(EnvError, match=r"expected unique tool names, got 'add' in 'Maths' and 'X'"):
        env.init_tool_groups([Maths(), MoreMaths(name="X")])


def test_base_text_env_defaults_and_context_manager() -> None:
    env = Echo()
    prompt = [{"role": "user", "content": "hi"}]
    assert env.init(prompt) == (prompt, {}) and env.get_metrics() == {}
    assert (env.turns, env.max_turns, env.tool_groups) == (0, 1, [])
    episodes = [{"a": 1, "ok": True, "s": "x"}, {"a": 2.0, "ok": False, "n": np.int64(4)}, {}]
    assert BaseTextEnv.aggregate_metrics(episodes) == {"a": 1.5, "ok": 0.5, "n": 4.0}
    assert skyrl_gym.metrics.aggregate_for_environment("calculator", episodes)["a"] == 1.5
    steps = skyrl_gym.metrics.aggregate_for_environment("gsm8k_multi_turn", [{"steps": 2}])
    assert steps == {"avg_steps": 2.0}
    with env as same:
        assert same is env and env.closed == 0
    assert env.closed == 1 and str(env) == "Env(Echo)"


GOOD = {"observations": [{"role": "user", "content": "o"}], "reward": 0.5, "done": False}


def test_read_step_output_accepts_a_step_output() -> None:
    got = skyrl_gym.read_step_output({**GOOD, "metadata": None}, env="e", turn=0)
    assert got == skyrl_gym.StepResult([{"role": "user", "content": "o"}], 0.5, False, {}, None)
    out = {**GOOD, "reward": np.float32(1), "done": np.bool_(True), "postprocessed_action": "p"}
    got = skyrl_gym.read_step_output({**out, "metadata": {"solved": True}}, env="e", turn=1)
    assert (got.reward, got.done, got.metadata, got.postprocessed_action) == (
        1.0,
        True,
        {"solved": True},
        "p",
    )
    assert type(got.reward) is float and type(got.done) is bool


@pytest.mark.parametrize(
    ("out", "field"),
    [
        ([GOOD], r"e.step \(turn 3\): expected a BaseTextEnvStepOutput dict.*got list"),
        ({"reward": 1.0}, r"e.step \(turn 3\): expected keys .*missing \['observations', 'done'\]"),
        ({**GOOD, "reward": math.nan}, r"\(turn 3\).reward: expected a finite number, got nan"),
        ({**GOOD, "reward": -math.inf}, r"\.reward: expected a finite number, got -inf"),
        ({**GOOD, "reward": True}, r"\.reward: expected a finite number, got True"),
        ({**GOOD, "reward": "1"}, r"\.reward: expected a finite number, got '1'"),
        ({**GOOD, "done": "yes"}, r"\(turn 3\).done: expected a bool, got 'yes'"),
        ({**GOOD, "done": 2}, r"\.done: expected a bool, got 2"),
        ({**GOOD, "observations": "hi"}, r"\.observations: expected a list of messages"),
        ({**GOOD, "observations": [{"role": "user"}]}, r"\.observations\[0\]: expected"),
        ({**GOOD, "observations": [{"role": 1, "content": "c"}]}, r"\.observations\[0\]"),
        ({**GOOD, "metadata": [1]}, r"\.metadata: expected a mapping or None, got \[1\]"),
        ({**GOOD, "postprocessed_action": b"x"}, r"\.postprocessed_action: expected a str"),
    ],
)
def test_read_step_output_refuses_malformed_outputs(out, field) -> None:
    with pytest.raises(EnvError, match=field):
        skyrl_gym.read_step_output(out, env="e", turn=3)


def test_make_task_env_builds_a_row_as_skyrl_generator_does(ids) -> None:
    reg(ids, "t_task", Echo)
    env = skyrl_gym.make_task_env(
        "t_task", {"q": 1}, env_configs={"t_task": {"depth": 3}}, max_turns=4
    )
    assert isinstance(env.env_config, DictConfig) and env.env_config.depth == 3
    assert env.extras == {"q": 1, "max_turns": 4}
    env = skyrl_gym.make_task_env("t_task", {"max_turns": 2}, max_turns=4)
    assert env.extras == {"max_turns": 2} and env.env_config == DictConfig({})
    assert skyrl_gym.make_task_env("t_task", {}).extras == {}  # no limit, none added
    node = DictConfig({"depth": 1})
    assert skyrl_gym.env_config_for({"t_task": node}, "t_task") is node
    with pytest.raises(EnvError, match=r"environment.skyrl_gym.t_task: expected a mapping .*got 3"):
        skyrl_gym.make_task_env("t_task", {}, env_configs={"t_task": 3})
    calls = []
    skyrl_gym.make_task_env(
        "t_task", {"a": 1}, max_turns=2, factory=lambda *a, **k: calls.append((a, k))
    )
    assert calls == [
        (("t_task",), {"env_config": DictConfig({}), "extras": {"a": 1, "max_turns": 2}})
    ]


def test_make_dataset_is_seeded_and_needs_sample_task(ids) -> None:
    first = skyrl_gym.make_dataset("gsm8k", num_prompts=5, seed=7)
    assert first == skyrl_gym.make_dataset("gsm8k", num_prompts=5, seed=7)
    assert first != skyrl_gym.make_dataset("gsm8k", num_prompts=5, seed=8)
    assert {t.env_name for t in first} == {"gsm8k"} and len(first) == 5
    reg(ids, "t_nosample", Echo)
    with pytest.raises(EnvError, match=r"make_dataset\('t_nosample'\): .*sample_task"):
        skyrl_gym.make_dataset("t_nosample", num_prompts=1, seed=0)
    with pytest.raises(EnvError, match=r"make_dataset.num_prompts: expected an int >= 0"):
        skyrl_gym.make_dataset("gsm8k", num_prompts=-1, seed=0)
