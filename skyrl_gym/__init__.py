"""Text environments for multi-turn RL, with SkyRL's API (``skyrl-gym`` 0.4.0).

    env = skyrl_gym.make("gsm8k", env_config=cfg, extras={"reward_spec": {...}})
    prompt, info = env.init(prompt)
    out = env.step(reply)       # {"observations", "reward", "done", "metadata"}

Writing an environment: ``docs/environments.md``. Added on top of SkyRL's API:
entry-point plugins, seeded generated datasets (``make_dataset``), checked step
outputs (``read_step_output``) and a sandbox for model-written code.
"""

from skyrl_gym import envs, error, metrics, tools  # noqa: E402,I001 - registers the built-ins
from skyrl_gym.core import Env, Message, Task, action_text, first_char
from skyrl_gym.envs.registration import (
    EnvSpec,
    deregister,
    make,
    pprint_registry,
    register,
    registered,
    registry,
    spec,
)
from skyrl_gym.error import EnvError
from skyrl_gym.steps import StepResult, read_step_output
from skyrl_gym.tasks import env_config_for, make_dataset, make_task_env

unregister = deregister
"""This package's earlier name for ``deregister``."""

__all__ = [
    "Env",
    "EnvError",
    "EnvSpec",
    "Message",
    "StepResult",
    "Task",
    "action_text",
    "deregister",
    "envs",
    "error",
    "first_char",
    "make",
    "make_dataset",
    "make_task_env",
    "metrics",
    "env_config_for",
    "pprint_registry",
    "read_step_output",
    "register",
    "registered",
    "registry",
    "spec",
    "tools",
    "unregister",
]
