"""``trainer.policy.routing_replay``: the replay mode (R3, R2 or off), whichever backend
trains, and its two deprecated aliases under ``trainer.policy.megatron_config``.

The mode was two ``MegatronConfig`` keys (``moe_enable_routing_replay``,
``routing_replay_source``); the FSDP backend replays routes too, so it has its own node
now. The old keys stay so existing launch scripts keep working:
``resolve_routing_replay`` copies one a user set into the node, once, where the config
is composed (``compose.parse_config``) or validated (``validate.validate_cfg``, for a
config built in Python), warns naming the new key and clears the alias, so every
reader reads the node alone. Under ``trainer.strategy=fsdp`` an alias is a Megatron key
and is left for ``strategy.check_strategy_keys`` to refuse.

Both workers take the mode as one ``routing_replay`` argument and never read an alias;
the factory still hands the Megatron worker a copy of its node with the run's mode in
the two keys (``megatron_worker_config``), so launch validation's Megatron rules read one
value, and a Python-built node whose alias disagrees with the argument is refused
(``refuse_conflicting_alias``).
"""

from __future__ import annotations

import dataclasses
import warnings

from skyrl_train.config.constraints import check_value, shown
from skyrl_train.config.schema import MegatronConfig, PPOConfig, RoutingReplayConfig
from skyrl_train.errors import ConfigValidationError

NODE = "trainer.policy.routing_replay"
MEGATRON_NODE = "trainer.policy.megatron_config"

ALIASES = {"moe_enable_routing_replay": "enabled", "routing_replay_source": "source"}
"""Deprecated ``megatron_config`` key -> its ``routing_replay`` field."""


def resolve_routing_replay(cfg: PPOConfig) -> None:
    """Copy each deprecated alias the config sets into ``trainer.policy.routing_replay``
    (in place), with a ``FutureWarning`` naming the new key, and clear it.

    The node's field counts as set when it differs from its default (a composed config
    cannot tell a default from the same value written out): an alias that disagrees
    with a set field is refused naming both keys. Idempotent: a resolved config has no
    alias left. Under another strategy than megatron the aliases are left as they are,
    for ``strategy.check_strategy_keys`` to refuse as Megatron keys.
    """
    if cfg.trainer.strategy != "megatron":
        return
    policy = cfg.trainer.policy
    mc, node, defaults = policy.megatron_config, policy.routing_replay, RoutingReplayConfig()
    rules = {f.name: dict(f.metadata) for f in dataclasses.fields(mc)}
    for alias, name in ALIASES.items():
        value = getattr(mc, alias)
        if value is None or not _holds(value, rules[alias]):
            continue  # a value its own rule refuses is named at validation, as the alias
        current = getattr(node, name)
        if current != getattr(defaults, name) and current != value:
            raise ConfigValidationError(
                f"{MEGATRON_NODE}.{alias}",
                expected=f"unset, or equal to {NODE}.{name} ({shown(current)}), which it is "
                "the deprecated alias of",
                got=shown(value),
            )
        warnings.warn(
            f"{MEGATRON_NODE}.{alias} is deprecated: set {NODE}.{name} instead "
            f"(taken as {NODE}.{name}={shown(value)})",
            FutureWarning,
            stacklevel=2,
        )
        setattr(node, name, value)
        setattr(mc, alias, None)


def _holds(value: object, rules: dict[str, object]) -> bool:
    try:
        check_value(value, "", **rules)
    except ConfigValidationError:
        return False
    return True


def megatron_replay_enabled(mc: MegatronConfig) -> bool:
    """The Megatron worker's replay switch, ``mc.moe_enable_routing_replay``: null (not
    set, the alias's default) is replay on, the default before the key became an
    alias, so a ``MegatronConfig()`` built in Python (tests, scripts) still replays."""
    return mc.moe_enable_routing_replay is not False


def megatron_worker_config(mc: MegatronConfig, replay: RoutingReplayConfig) -> MegatronConfig:
    """A copy of ``mc`` with the run's replay mode (``replay``, the
    ``trainer.policy.routing_replay`` node) in the two keys the Megatron worker reads,
    so the worker acts on the run's mode, never on a null alias's default."""
    return dataclasses.replace(
        mc, moe_enable_routing_replay=replay.enabled, routing_replay_source=replay.source
    )


def refuse_conflicting_alias(mc: MegatronConfig, *, routing_replay: bool) -> None:
    """Refuse a ``megatron_config`` node ``mc`` whose deprecated
    ``moe_enable_routing_replay`` disagrees with the worker's ``routing_replay``: the
    worker replays by the argument alone, and a launch resolves the alias away, so only
    a node built in Python can hold one, which must not be silently overridden."""
    alias = mc.moe_enable_routing_replay
    if alias is not None and alias != routing_replay:
        raise ConfigValidationError(
            f"{MEGATRON_NODE}.moe_enable_routing_replay",
            expected=f"unset, or equal to the worker's routing_replay ({shown(routing_replay)}, "
            f"{NODE}.enabled), which it is the deprecated alias of",
            got=shown(alias),
        )


def check_routing_replay(cfg: PPOConfig) -> None:
    """Replay from the rollout (R3) needs the engine to return the rollout's routes."""
    # The reference policy swaps its weights into the policy's model (trainer.ref), so
    # the policy's settings are the only ones to check.
    node = cfg.trainer.policy.routing_replay
    if not node.enabled or node.source != "rollout":
        return
    if not cfg.generator.inference_engine.enable_return_routed_experts:
        raise ConfigValidationError(
            f"{NODE}.enabled",
            "replay from the rollout needs the rollout's routes, but "
            "generator.inference_engine.enable_return_routed_experts is false "
            f"({NODE}.source=old_policy replays the trainer's own)",
        )
