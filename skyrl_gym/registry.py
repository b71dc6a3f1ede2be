"""Name → environment factory, and seeded prompt datasets built locally from it."""

from __future__ import annotations

import importlib
import inspect
import random
import warnings
from collections.abc import Callable
from typing import Any

from skyrl_gym.core import Env, Task
from skyrl_gym.errors import EnvError

EnvFactory = Callable[..., Any]
"""An ``Env`` subclass, or any callable returning an object with ``init`` and ``step``."""

_REGISTRY: dict[str, EnvFactory | str] = {}
ENTRY_POINT_GROUP = "skyrl_gym.envs"
"""Installed packages register environments here (``name = "module:attribute"`` under
``[project.entry-points."skyrl_gym.envs"]``); ``register()`` calls win over them."""
_entry_points_loaded = False


def _load_entry_points() -> None:
    """Adds the ``skyrl_gym.envs`` entry points once, as ``module:attribute`` strings:
    nothing is imported until ``make`` builds one, so a broken plugin fails only when
    asked for, with its name."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        _REGISTRY.setdefault(ep.name, ep.value)


def reload_entry_points() -> None:
    """Reads the entry points again (after installing a plugin in a running process)."""
    global _entry_points_loaded
    _entry_points_loaded = False
    _load_entry_points()


def register(id: str, entry_point: EnvFactory | str) -> None:  # noqa: A002 - gym's name
    """Register ``entry_point`` as environment ``id``.

    ``entry_point`` is a factory (an ``Env`` subclass, or a callable returning an object
    with ``init`` and ``step``) or a ``"module:attribute"`` string imported at ``make``
    time. Re-registering an id replaces it with a warning, as gym does.
    """
    if not isinstance(id, str) or not id:
        raise EnvError(f"register.id: expected a non-empty str, got {id!r}")
    if isinstance(entry_point, str):
        if ":" not in entry_point:
            raise EnvError(
                f"register.entry_point: expected 'module:attribute' or a callable, "
                f"got {entry_point!r}"
            )
    elif not callable(entry_point):
        raise EnvError(
            f"register.entry_point: expected a callable returning an environment, "
            f"got {entry_point!r}"
        )
    previous = _REGISTRY.get(id)
    if previous is not None and previous is not entry_point:
        warnings.warn(f"skyrl_gym.register: replacing environment {id!r}", stacklevel=2)
    _REGISTRY[id] = entry_point


def unregister(name: str) -> None:
    """Remove ``name`` (plugins and tests that register temporary environments)."""
    if _REGISTRY.pop(name, None) is None:
        raise EnvError(f"unregister.name: expected one of {registered()}, got {name!r}")


def registered() -> list[str]:
    """Registered environment names (entry points included), sorted."""
    _load_entry_points()
    return sorted(_REGISTRY)


def _factory(name: str) -> EnvFactory:
    _load_entry_points()
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise EnvError(f"make.name: expected one of {registered()}, got {name!r}") from None
    if not isinstance(entry, str):
        return entry
    module_name, _, attribute = entry.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise EnvError(f"make({name!r}): cannot import entry point {entry!r} ({exc})") from exc
    _REGISTRY[name] = factory
    return factory


def make(name: str, **kwargs: Any) -> Env:
    """Build a fresh environment; keyword arguments are checked against the factory."""
    factory = _factory(name)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise EnvError(
            f"make({name!r}) kwargs: expected the factory's parameters, got {sorted(kwargs)} ({exc})"
        ) from None
    env = factory(**kwargs)
    if not (callable(getattr(env, "init", None)) and callable(getattr(env, "step", None))):
        raise EnvError(
            f"make({name!r}): expected an environment with init() and step(), "
            f"got {type(env).__name__}"
        )
    return env


def make_dataset(name: str, *, num_prompts: int, seed: int, **task_kwargs: Any) -> list[Task]:
    """``num_prompts`` tasks for ``name``, identical for the same ``seed``.

    ``task_kwargs`` go to the environment's ``sample_task`` (``turns`` for
    ``repeat_letter``, say). Datasets are generated here, never downloaded.
    """
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 0:
        raise EnvError(f"make_dataset.num_prompts: expected an int >= 0, got {num_prompts!r}")
    factory = _factory(name)
    sample = getattr(factory, "sample_task", None)
    if sample is None:
        raise EnvError(
            f"make_dataset({name!r}): expected a factory with sample_task, got {factory!r}"
        )
    # A string seed keeps datasets of different environments independent for one seed.
    rng = random.Random(f"{name}:{seed}")
    tasks = []
    for _ in range(num_prompts):
        prompt, extras = sample(rng, **task_kwargs)
        tasks.append(Task(prompt=prompt, env_name=name, env_extras=extras, data_source=name))
    return tasks
