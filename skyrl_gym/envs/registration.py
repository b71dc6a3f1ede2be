"""Environment ids → how to build them: SkyRL's ``register`` / ``make`` / ``spec``.

    register(id="my_env", entry_point="my_pkg.env:MyEnv", kwargs={...})
    env = make("my_env", env_config=cfg, extras=row)

Added on top of SkyRL's registry: installed packages register environments through
the ``skyrl_gym.envs`` entry-point group (``name = "module:Class"``), read the first
time an id is looked up; ``make`` checks the keyword arguments against the factory
before calling it and names the environment in every error.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from skyrl_gym.core import Env
from skyrl_gym.error import EnvError, EnvTypeError, RegistrationError

EnvCreator = Callable[..., Env]
ENTRY_POINT_GROUP = "skyrl_gym.envs"
"""Installed packages register environments here (``name = "module:attribute"`` under
``[project.entry-points."skyrl_gym.envs"]``); a ``register()`` call wins over them."""


@dataclass
class EnvSpec:
    """How to build environment ``id``: ``entry_point`` (a ``"module:attribute"`` string
    or a callable returning a ``skyrl_gym.Env``) called with ``kwargs`` updated by
    ``make``'s."""

    id: str
    entry_point: EnvCreator | str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.id

    def make(self, **kwargs: Any) -> Env:
        return make(self, **kwargs)


registry: dict[str, EnvSpec] = {}
"""Every registered id (entry points once looked up); use ``register`` to add."""
_entry_points_loaded = False
_from_entry_points: set[str] = set()
"""Ids only an entry point declared: ``register`` may take them over."""


def _load_entry_points() -> None:
    """Adds the ``skyrl_gym.envs`` entry points once, as strings: nothing is imported
    until ``make`` builds one, so a broken plugin fails only when asked for."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in registry:  # a register() call wins over an entry point
            registry[ep.name] = EnvSpec(id=ep.name, entry_point=ep.value)
            _from_entry_points.add(ep.name)


def reload_entry_points() -> None:
    """Reads the entry points again (after installing a plugin in a running process)."""
    global _entry_points_loaded
    _entry_points_loaded = False
    _load_entry_points()


def register(
    id: str,  # noqa: A002 - SkyRL's (and gym's) name
    entry_point: EnvCreator | str | None = None,
    kwargs: dict[str, Any] | None = None,
) -> None:
    """Register environment ``id``; an id already registered raises
    ``RegistrationError`` (``deregister`` it first), as in SkyRL."""
    if not isinstance(id, str) or not id:
        raise RegistrationError(f"register.id: expected a non-empty str, got {id!r}")
    if isinstance(entry_point, str):
        module, _, attribute = entry_point.partition(":")
        if not module or not attribute:
            raise RegistrationError(
                f"register({id!r}).entry_point: expected 'module:attribute' or a callable, "
                f"got {entry_point!r}"
            )
    elif not callable(entry_point):
        raise RegistrationError(
            f"register({id!r}).entry_point: expected 'module:attribute' or a callable, "
            f"got {entry_point!r}"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RegistrationError(f"register({id!r}).kwargs: expected a dict, got {kwargs!r}")
    # Entry points are not read here: one read later keeps this registration.
    existing = registry.get(id)
    if existing is not None and id not in _from_entry_points:
        raise RegistrationError(
            f"register.id: expected an id not yet registered, got {id!r} "
            f"(registered to {existing.entry_point!r}; deregister it first)"
        )
    registry[id] = EnvSpec(id=id, entry_point=entry_point, kwargs=dict(kwargs or {}))
    _from_entry_points.discard(id)


def deregister(id: str) -> None:  # noqa: A002 - SkyRL's name
    """Remove ``id`` (plugins and tests that register temporary environments)."""
    _from_entry_points.discard(id)
    if registry.pop(id, None) is None:
        raise EnvError(f"deregister.id: expected one of {registered()}, got {id!r}")


def registered() -> list[str]:
    """Registered ids (entry points included), sorted."""
    _load_entry_points()
    return sorted(registry)


def spec(env_id: str) -> EnvSpec:
    """The ``EnvSpec`` of ``env_id``; an unknown id raises ``EnvError`` naming the known."""
    _load_entry_points()
    found = registry.get(env_id)
    if found is None:
        raise EnvError(f"make.id: expected one of {registered()}, got {env_id!r}")
    return found


def load_env_creator(name: str) -> EnvCreator:
    """The attribute ``"module:attribute"`` names, imported; the attribute may be dotted
    (``"pkg.mod:Outer.create"``), as in an entry point."""
    module_name, _, attribute = name.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise EnvError(f"entry point {name!r}: cannot import it ({exc})") from exc
    if not callable(found):
        raise EnvError(
            f"entry point {name!r}: expected a callable returning a skyrl_gym.Env, "
            f"got {type(found).__name__}"
        )
    return found  # type: ignore[no-any-return]


def creator(env_id: str) -> EnvCreator:
    """The factory registered as ``env_id``, imported if it was a string."""
    return _spec_factory(spec(env_id))


def make(id: str | EnvSpec, **kwargs: Any) -> Env:  # noqa: A002 - SkyRL's name
    """A fresh environment: the factory called with the spec's ``kwargs`` updated by
    ``kwargs`` (``env_config=..., extras=...`` for a ``BaseTextEnv``)."""
    env_spec = id if isinstance(id, EnvSpec) else spec(id)
    factory = _spec_factory(env_spec)
    merged = copy.deepcopy(env_spec.kwargs)
    merged.update(kwargs)
    try:
        inspect.signature(factory).bind(**merged)
    except TypeError as exc:
        raise EnvTypeError(
            f"make({env_spec.id!r}).kwargs: expected the factory's parameters "
            f"{_parameters(factory)}, got {sorted(merged)} ({exc})"
        ) from None
    except ValueError:  # a builtin without a signature: let the call decide
        pass
    env = factory(**merged)
    if not isinstance(env, Env):
        raise EnvTypeError(
            f"make({env_spec.id!r}): expected a skyrl_gym.Env (subclass "
            f"skyrl_gym.envs.base_text_env.BaseTextEnv), got {type(env).__name__}"
        )
    env.spec = EnvSpec(id=env_spec.id, entry_point=env_spec.entry_point, kwargs=merged)
    return env


def _spec_factory(env_spec: EnvSpec) -> EnvCreator:
    entry = env_spec.entry_point
    if entry is None:
        raise EnvError(f"{env_spec.id}.entry_point: expected a factory, got None")
    if isinstance(entry, str):
        try:
            return load_env_creator(entry)
        except EnvError as exc:
            raise EnvError(f"make({env_spec.id!r}): {exc}") from exc
    return entry


def _parameters(factory: EnvCreator) -> list[str]:
    try:
        return list(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return []


def pprint_registry(
    print_registry: dict[str, EnvSpec] | None = None,
    *,
    num_cols: int = 3,
    disable_print: bool = False,
) -> str | None:
    """The registered ids in ``num_cols`` columns; returned instead of printed when
    ``disable_print``."""
    if print_registry is None:
        _load_entry_points()
        print_registry = registry
    ids = sorted(print_registry)
    if not ids:
        text = "No environments registered."
    else:
        width = max(len(i) for i in ids) + 2
        rows = [ids[at : at + num_cols] for at in range(0, len(ids), num_cols)]
        text = "\n".join("".join(i.ljust(width) for i in row).rstrip() for row in rows)
    if disable_print:
        return text
    print(text)
    return None
