"""Name → environment factory, and seeded prompt datasets built locally from it."""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

from skyrl_gym.core import Env, Task
from skyrl_gym.errors import EnvError

EnvFactory = Callable[..., Env]

_REGISTRY: dict[str, EnvFactory] = {}


def register(name: str, factory: EnvFactory, *, overwrite: bool = False) -> None:
    """Register ``factory`` (an ``Env`` subclass or a callable returning one) as ``name``.

    Re-registering a name raises unless ``overwrite``: two plugins silently replacing
    each other's environment is a bug worth a loud error.
    """
    if not isinstance(name, str) or not name:
        raise EnvError(f"register.name: expected a non-empty str, got {name!r}")
    if not callable(factory):
        raise EnvError(f"register.factory: expected a callable returning an Env, got {factory!r}")
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not factory:
        raise EnvError(f"register.name: expected an unused name, got {name!r} (already registered)")
    _REGISTRY[name] = factory


def unregister(name: str) -> None:
    """Remove ``name`` (plugins and tests that register temporary environments)."""
    if _REGISTRY.pop(name, None) is None:
        raise EnvError(f"unregister.name: expected one of {registered()}, got {name!r}")


def registered() -> list[str]:
    """Registered environment names, sorted."""
    return sorted(_REGISTRY)


def _factory(name: str) -> EnvFactory:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise EnvError(f"make.name: expected one of {registered()}, got {name!r}") from None


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
    if not isinstance(env, Env):
        raise EnvError(
            f"make({name!r}): expected the factory to return an Env, got {type(env).__name__}"
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
        tasks.append(Task(prompt=prompt, env_name=name, env_extras=extras))
    return tasks
