"""Launch validation is split by side (``skyrl_train/config/validate.py``'s docstring):
each rule module reads in one sitting, and every name other code imports from
``validate.py`` is still there, the same object as in the module that now holds it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

import skyrl_train.config
from skyrl_train.config import (
    engine_rules,
    megatron_rules,
    megatron_unsupported,
    routing_replay,
    strategy,
    validate,
)

ROOT = Path(__file__).resolve().parents[3]


def _size_limit() -> int:
    spec = importlib.util.spec_from_file_location(
        "check_module_size", ROOT / "scripts" / "check_module_size.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return int(script.LIMIT)


@pytest.mark.parametrize(
    "module",
    [validate, engine_rules, megatron_rules, megatron_unsupported, routing_replay, strategy],
    ids=lambda m: m.__name__,
)
def test_each_rule_module_is_within_the_size_limit(module: ModuleType) -> None:
    assert module.__file__ is not None
    lines = Path(module.__file__).read_text(encoding="utf-8").count("\n")
    assert lines <= _size_limit(), f"{module.__name__}: {lines} lines"


def test_names_imported_from_validate_are_the_rule_modules_own() -> None:
    homes = {
        "UNSUPPORTED_MEGATRON_SETTINGS": megatron_unsupported,
        "refuse_replay_incompatible": megatron_unsupported,
        "EXPERT_TENSOR_SIZES_WITH_EXPERTS": megatron_rules,
        "check_sampling_params": engine_rules,
    }
    assert set(validate.__all__) == {*homes, "validate_cfg"}
    for name, home in homes.items():
        assert getattr(validate, name) is getattr(home, name), name
    assert (
        skyrl_train.config.refuse_replay_incompatible
        is megatron_unsupported.refuse_replay_incompatible
    )
