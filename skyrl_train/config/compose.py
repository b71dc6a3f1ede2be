"""``configs/ppo_base_config.yaml`` plus overrides, composed by Hydra into ``PPOConfig``.

The schema (``schema.PPOConfig``) is registered in Hydra's ConfigStore as
``ppo_schema`` and heads the YAML's defaults list, so composition type-checks: an
unknown key or a value of the wrong type fails there, ``--cfg job`` included. This
module turns those failures into ``ConfigValidationError`` (with the closest real key
for a misspelt one) and the composed tree into the typed dataclasses.

    cfg = load_config(["trainer.num_steps=5", "model=qwen3_moe_tiny"])
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.routing_replay import resolve_routing_replay
from skyrl_train.config.sample_packing import resolve_sample_packing
from skyrl_train.config.schema import PPOConfig
from skyrl_train.errors import ConfigValidationError

CONFIG_NAME = "ppo_base_config"
SCHEMA_NAME = "ppo_schema"


def _config_dir() -> Path:
    # The checkout's configs/ (an editable install, as the README does it); a
    # non-editable install has no checkout beside the package, so fall back to the
    # configs/ of the folder the launch runs in.
    for candidate in (Path(__file__).resolve().parents[2] / "configs", Path.cwd() / "configs"):
        if (candidate / f"{CONFIG_NAME}.yaml").is_file():
            return candidate
    return Path(__file__).resolve().parents[2] / "configs"


CONFIG_DIR = _config_dir()
"""The Hydra config folder at the repository root."""

ConfigStore.instance().store(name=SCHEMA_NAME, node=PPOConfig)


def load_config(
    overrides: Sequence[str] | None = None,
    *,
    config_dir: str | Path = CONFIG_DIR,
    config_name: str = CONFIG_NAME,
) -> PPOConfig:
    """Compose the YAML with Hydra override strings (``a.b=1``, ``+a.c=2``,
    ``model=<preset>``) into ``PPOConfig``.

    Must not be called inside a running ``@hydra.main`` (Hydra allows one global
    instance); there use ``parse_config(cfg)`` on the config Hydra hands over.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    overrides = list(overrides or [])
    check_override_keys(overrides)
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise composition_error(exc) from exc
    return parse_config(cfg)


def parse_config(cfg: DictConfig | Mapping[str, Any]) -> PPOConfig:
    """A composed config (Hydra's ``DictConfig``, or a plain nested mapping of overrides
    to the defaults) as ``PPOConfig``; types are checked by OmegaConf on the way. A
    deprecated replay alias the config sets is moved into
    ``trainer.policy.routing_replay`` with a warning (``routing_replay.py``), and
    ``trainer.use_sample_packing`` into ``trainer.remove_microbatch_padding``
    (``sample_packing.py``)."""
    try:
        typed: Any = cfg
        if not (isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is PPOConfig):
            typed = OmegaConf.merge(OmegaConf.structured(PPOConfig), cfg)
        obj = OmegaConf.to_object(typed)
    except OmegaConfBaseException as exc:
        raise composition_error(exc) from exc
    except ValueError as exc:  # TinyMoEConfig's own checks: "TinyMoEConfig.<field>: ..."
        field, _, reason = str(exc).partition(": ")
        name = field.removeprefix("TinyMoEConfig").lstrip(".")
        raise ConfigValidationError(f"model.builtin.{name}".rstrip("."), reason) from exc
    if not isinstance(obj, PPOConfig):
        raise ConfigValidationError("<root>", expected="the PPOConfig schema", got=str(type(obj)))
    resolve_routing_replay(obj)  # the deprecated megatron_config replay keys, once
    resolve_sample_packing(obj)  # trainer.use_sample_packing, SkyRL's old name
    return obj


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass, e.g. to save it as YAML."""
    return typing.cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(cfg)))


# ------------------------------------------------------------------- errors, keys


def composition_error(exc: BaseException) -> ConfigValidationError:
    """A Hydra/OmegaConf composition failure as a ``ConfigValidationError`` on the key
    it is about; an unknown key names the closest real one."""
    missing = re.search(r"Could not find '(\w+)/([^']*)'", str(exc))
    if missing:
        group, option = missing.groups()
        return ConfigValidationError(
            group, expected=f"one of {group_options(group)}", got=repr(option)
        )
    cause: BaseException | None = exc
    while cause is not None:
        full_key = getattr(cause, "full_key", None)
        if full_key:
            reason = str(cause).splitlines()[0]
            if "not in" in reason or "is not in struct" in reason:
                return unknown_key_error(str(full_key))
            return ConfigValidationError(str(full_key), _omegaconf_reason(reason))
        cause = cause.__cause__ or cause.__context__
    return ConfigValidationError("<overrides>", str(exc).splitlines()[0])


def check_override_keys(overrides: Sequence[str]) -> None:
    """Refuse an override whose key the schema does not declare, before composing.

    Hydra's own message for one ("Could not override ...") names no alternative; this
    names the closest key. ``+a.b=1`` may only add a key under a free-form mapping
    (Hydra would otherwise add it to a schema node, where nothing reads it). Group
    choices (``model=x``), deletions and Hydra's own keys pass through to Hydra.
    """
    for item in overrides:
        if "=" not in item or item.startswith(("~", "hydra.", "-")):
            continue
        key = item.split("=", 1)[0]
        if key.startswith("+"):
            key = key.lstrip("+")
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            if not parent or _locate(parent) != "mapping":
                raise unknown_key_error(key)
            continue
        if "." not in key and key in GROUPS:
            continue
        if _locate(key) is None:
            raise unknown_key_error(key)


def group_options(group: str) -> list[str]:
    """The presets of config group ``group``: ``configs/<group>/*.yaml`` stems."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def unknown_key_error(key: str) -> ConfigValidationError:
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    known = sorted(_all_keys())
    moved = [new + key[len(old) :] for old, new in MOVED.items() if f"{key}.".startswith(f"{old}.")]
    close = moved[:1]
    close = close or difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:  # a leaf misspelt beyond the whole-key cutoff: try its siblings
        siblings = [k for k in known if k.rsplit(".", 1)[0] == parent] if parent else []
        close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.0)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigValidationError(key, expected=f"a key the schema declares{hint}", got=repr(key))


GROUPS = ("model", "environment", "data", "preset")
"""Config groups (``configs/<group>/<option>.yaml``): ``model=tiny`` picks a file.
``preset`` (none by default) sets keys anywhere in the tree: a real model size's
parallel layout, batch sizes and engine settings (``configs/preset/``)."""

MOVED: dict[str, str] = {
    **{f"model.{name}": f"model.builtin.{name}" for name in TinyMoEConfig.__dataclass_fields__},
    "model.top_k": "model.builtin.num_experts_per_tok",
    "model.builtin.top_k": "model.builtin.num_experts_per_tok",
    "generator.max_trajectory_tokens": "generator.max_response_tokens",
    "logging.jsonl": "logging.trackers",
    "logging.tensorboard": "logging.trackers",
    "environment.kwargs": "environment.skyrl_gym.<env_class>",
}
"""Keys renamed by the config tree's rework (issue 14), so an old launch script is told
where its key went: difflib alone suggests ``model.path`` for ``model.top_k``."""


def _all_keys(cls: type = PPOConfig, prefix: str = "") -> Iterator[str]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = f"{prefix}{f.name}"
        yield key
        tp = _node_type(hints[f.name])
        if tp is not None:
            yield from _all_keys(tp, key + ".")


def _locate(key: str) -> str | None:
    """What the schema declares at ``key``: ``"node"`` (a dataclass), ``"leaf"`` (a
    value), ``"mapping"`` (a free-form mapping field, or any key below one), or None
    when it declares nothing there."""
    node: Any = PPOConfig
    for part in key.split("."):
        if node is dict:  # below a free-form mapping: anything goes
            return "mapping"
        if node is None or part not in {f.name for f in dataclasses.fields(node)}:
            return None
        tp = typing.get_type_hints(node)[part]
        node = dict if _is_mapping(tp) else _node_type(tp)
    return "mapping" if node is dict else "leaf" if node is None else "node"


def _node_type(tp: Any) -> type | None:
    """The dataclass a field holds (``X | None`` unwrapped), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _is_mapping(tp: Any) -> bool:
    return typing.get_origin(tp) is dict


def _omegaconf_reason(message: str) -> str:
    # OmegaConf says "Value 'abc' of type 'str' could not be converted to Integer" or
    # "Value 'maybe' is not a valid bool (type str)"; say it as "expected X, got Y".
    if "could not be converted to" in message:
        got, _, kind = message.partition(" could not be converted to ")
        return f"expected {kind.strip().lower()}, got {got.removeprefix('Value ').strip()}"
    match = re.match(r"Value (.*) is not a valid (\w+) \(type (\w+)\)", message)
    if match:
        got, kind, got_type = match.groups()
        return f"expected {kind}, got {got} of type '{got_type}'"
    return message
