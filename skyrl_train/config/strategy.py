"""``trainer.strategy``: which trainer backend a run uses, and the launch rules that
depend on it.

- Each backend has its own node under ``trainer.policy`` (``BACKEND_NODES``); a key of
  the other backend's node set away from its default is refused, naming the key and the
  strategy (``check_strategy_keys``), so a Megatron layout never silently goes unused
  under FSDP, nor an FSDP setting under Megatron. The deprecated replay aliases in
  ``megatron_config`` count as Megatron keys (``routing_replay.py``).
- ``data_parallel_size``: the data-parallel ranks the batch sizes divide by, the one
  place that answers it per backend. FSDP shards one model over every trainer rank (data
  parallel only), so it is ``trainer.placement.num_trainers``; Megatron's is what its
  layout leaves (``megatron_rules.data_parallel_size``).

The Megatron-only rules (``megatron_rules.py``, ``megatron_unsupported.py``) run only
with ``trainer.strategy=megatron`` (``validate.py``). FSDP needs no rule of its own
here yet: any ``num_trainers`` >= 1 and any ``trainer.placement.strategy`` place its
ranks as they place Megatron's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from skyrl_train.config.constraints import shown
from skyrl_train.config.megatron_rules import data_parallel_size as megatron_dp_size
from skyrl_train.config.schema import (
    FSDPConfig,
    MegatronConfig,
    PPOConfig,
    TrainerConfig,
)
from skyrl_train.errors import ConfigValidationError

POLICY = "trainer.policy"

BACKEND_NODES: dict[str, tuple[str, type]] = {
    "megatron": ("megatron_config", MegatronConfig),
    "fsdp": ("fsdp_config", FSDPConfig),
}
"""Strategy (``schema.STRATEGIES``) -> its node under ``trainer.policy`` and the node's
dataclass."""


def backend_node(trainer: TrainerConfig) -> tuple[str, Any]:
    """The active backend's node name under ``trainer.policy`` and its value."""
    name, _cls = BACKEND_NODES[trainer.strategy]
    return name, getattr(trainer.policy, name)


def data_parallel_size(trainer: TrainerConfig) -> int:
    """How many data-parallel ranks ``trainer.placement.num_trainers`` ranks make under
    ``trainer.strategy``: every rank for FSDP, what tensor, pipeline and context
    parallelism leave for Megatron."""
    world = trainer.placement.num_trainers
    if trainer.strategy == "fsdp":
        return world
    return megatron_dp_size(trainer.policy.megatron_config, world=world)


def check_strategy_keys(cfg: PPOConfig) -> None:
    """Refuse a key of another backend's node that is not at its default, naming the
    key, its default and ``trainer.strategy``."""
    strategy = cfg.trainer.strategy
    for other, (name, cls) in BACKEND_NODES.items():
        if other == strategy:
            continue
        node = getattr(cfg.trainer.policy, name)
        for key, value, default in _changed(node, cls(), f"{POLICY}.{name}"):
            raise ConfigValidationError(
                key,
                expected=f"{shown(default)} (its default) with trainer.strategy={strategy}: "
                f"a key of the {other} backend, which this run does not use (the "
                f"{strategy} backend's keys are under "
                f"{POLICY}.{BACKEND_NODES[strategy][0]})",
                got=shown(value),
            )


def _changed(node: Any, default: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """``(dotted key, value, default)`` of every field of ``node`` that differs from
    ``default``, in field order; a free-form mapping reports each key it holds that the
    default does not, or holds with another value."""
    found: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(node):
        value, want, key = getattr(node, f.name), getattr(default, f.name), f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            found += _changed(value, want, key)
        elif isinstance(value, dict) and isinstance(want, dict):
            found += [
                (f"{key}.{k}", v, want.get(k))
                for k, v in value.items()
                if k not in want or want[k] != v
            ]
        elif value != want:
            found.append((key, value, want))
    return found
