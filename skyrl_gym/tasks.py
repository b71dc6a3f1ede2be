"""Tasks (dataset rows) and the environment each one runs in.

``make_dataset``: seeded prompts generated locally from an environment's
``sample_task`` (this package's addition: nothing is downloaded). ``make_task_env``:
a row's environment built as SkyRL's generator builds it, ``make(env_class,
env_config=<environment.skyrl_gym.<env_class>>, extras=<the row's fields>)``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from skyrl_gym.core import Task
from skyrl_gym.envs.registration import creator, make
from skyrl_gym.error import EnvError


def make_dataset(name: str, *, num_prompts: int, seed: int, **task_kwargs: Any) -> list[Task]:
    """``num_prompts`` tasks for environment ``name``, identical for the same ``seed``.

    The environment's class provides ``sample_task(rng, **task_kwargs) -> (prompt,
    extras)``; each task's ``env_extras`` is the ``extras`` its episode is built with.
    """
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 0:
        raise EnvError(f"make_dataset.num_prompts: expected an int >= 0, got {num_prompts!r}")
    factory = creator(name)
    sample = getattr(factory, "sample_task", None)
    if sample is None:
        raise EnvError(
            f"make_dataset({name!r}): expected an environment class with sample_task "
            f"(a generated dataset), got {factory!r}; give data.train_data rows instead"
        )
    # A string seed keeps datasets of different environments independent for one seed.
    rng = random.Random(f"{name}:{seed}")
    tasks = []
    for _ in range(num_prompts):
        prompt, extras = sample(rng, **task_kwargs)
        tasks.append(Task(prompt=prompt, env_name=name, env_extras=extras, data_source=name))
    return tasks


def env_config_for(env_configs: Mapping[str, Any] | None, env_class: str) -> Any:
    """``env_configs[env_class]`` as an OmegaConf node (SkyRL's environments read
    settings as attributes, ``env_config.db_path``); an empty node when absent."""
    from omegaconf import DictConfig, OmegaConf

    node = (env_configs or {}).get(env_class)
    if node is None:
        return OmegaConf.create({})
    if isinstance(node, DictConfig):
        return node
    if not isinstance(node, Mapping):
        raise EnvError(
            f"environment.skyrl_gym.{env_class}: expected a mapping of settings, got {node!r:.80}"
        )
    return OmegaConf.create(dict(node))


def task_extras(extras: Mapping[str, Any], *, max_turns: int | None) -> dict[str, Any]:
    """The row's fields, with ``max_turns`` (the generator's limit) when the row gives
    none, as SkyRL's generator adds it."""
    out = dict(extras)
    if max_turns is not None:
        out.setdefault("max_turns", max_turns)
    return out


def make_task_env(
    env_class: str,
    extras: Mapping[str, Any],
    *,
    env_configs: Mapping[str, Any] | None = None,
    max_turns: int | None = None,
    factory: Callable[..., Any] = make,
) -> Any:
    """The environment of one row (a ``skyrl_gym.Env`` from ``make``); ``factory`` is
    ``make`` or a stand-in with its signature (the evaluation command's, which records
    failures, returns a wrapper)."""
    return factory(
        env_class,
        env_config=env_config_for(env_configs, env_class),
        extras=task_extras(extras, max_turns=max_turns),
    )
