"""``trainer.remove_microbatch_padding`` and its deprecated alias ``trainer.use_sample_packing``.

SkyRL renamed ``use_sample_packing`` to ``remove_microbatch_padding`` in 0.4.0 and
still accepts the old name; so does this project, so a SkyRL launch script carries
over. ``resolve_sample_packing`` runs where the replay aliases are resolved
(``compose.parse_config`` and ``validate.validate_cfg``, for a config built in
Python): an alias the config sets is copied into ``remove_microbatch_padding`` with a
``FutureWarning`` naming the new key, and cleared, so the factory and the workers read
the one key alone.
"""

from __future__ import annotations

import warnings

from skyrl_train.config.constraints import shown
from skyrl_train.config.schema import PPOConfig, TrainerConfig
from skyrl_train.errors import ConfigValidationError

KEY = "trainer.remove_microbatch_padding"
ALIAS = "trainer.use_sample_packing"


def resolve_sample_packing(cfg: PPOConfig) -> None:
    """Copy a set ``trainer.use_sample_packing`` into ``trainer.remove_microbatch_padding``
    (in place), warning, and clear it. The new key counts as set when it differs from
    its default (a composed config cannot tell a default from the same value written
    out), as for the replay aliases (``routing_replay.resolve_routing_replay``): an
    alias that disagrees with a set key is refused naming both. Idempotent."""
    trainer = cfg.trainer
    alias = trainer.use_sample_packing
    if alias is None:
        return
    current = trainer.remove_microbatch_padding
    if current != TrainerConfig.remove_microbatch_padding and current != alias:
        raise ConfigValidationError(
            ALIAS,
            expected=f"unset, or equal to {KEY} ({shown(current)}), which it is the "
            "deprecated alias of",
            got=shown(alias),
        )
    warnings.warn(
        f"{ALIAS} is deprecated: set {KEY} instead (taken as {KEY}={shown(alias)})",
        FutureWarning,
        stacklevel=2,
    )
    trainer.remove_microbatch_padding = alias
    trainer.use_sample_packing = None
