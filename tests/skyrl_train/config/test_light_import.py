"""A trainer rank imports the config schema, never the launch validator: the rank
process imports ``PolicyTrainer`` and its worker, and an eager ``config/__init__.py``
(or ``generators/__init__.py``) made each of them load ``validate.py``, its rule
modules, Hydra and skyrl_gym."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import skyrl_train.config
from skyrl_train.config import compose, megatron_unsupported, schema, validate

# What only the driver's launch check needs.
LAUNCH_ONLY = [
    "skyrl_train.config.validate",
    "skyrl_train.config.engine_rules",
    "skyrl_train.config.megatron_rules",
    "skyrl_train.config.model_source",
    "skyrl_train.config.remote_servers",
    "skyrl_train.config.sampler_replay",
    "skyrl_train.config.algorithm_rules",
    "skyrl_train.config.strategy",
    "skyrl_train.config.compose",
    "skyrl_train.generators.gym_generator",
    "skyrl_gym",
    "hydra",
]


def _loaded_after(*modules: str) -> set[str]:
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"print(json.dumps(sorted(set(sys.modules) & set({LAUNCH_ONLY!r}))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_the_config_package_loads_none_of_its_modules() -> None:
    assert _loaded_after("skyrl_train.config") == set()


def test_a_trainer_rank_imports_no_launch_rule() -> None:
    loaded = _loaded_after(
        "skyrl_train.trainer.policy",
        "skyrl_train.workers.factory",
        "skyrl_train.workers.megatron.worker",
        "skyrl_train.workers.fsdp.worker",
    )
    assert loaded == set(), f"a rank imported {sorted(loaded)}"


def test_public_names_still_resolve_to_their_owners() -> None:
    assert skyrl_train.config.validate_cfg is validate.validate_cfg
    assert skyrl_train.config.load_config is compose.load_config
    assert skyrl_train.config.PPOConfig is schema.PPOConfig
    assert (
        skyrl_train.config.refuse_replay_incompatible
        is megatron_unsupported.refuse_replay_incompatible
    )
    for name in skyrl_train.config.__all__:
        assert name in dir(skyrl_train.config)
        getattr(skyrl_train.config, name)
    with pytest.raises(
        AttributeError, match="'skyrl_train.config' has no attribute 'validate_config'"
    ):
        skyrl_train.config.validate_config  # noqa: B018
