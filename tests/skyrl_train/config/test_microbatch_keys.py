"""``trainer.max_tokens_per_microbatch`` (-1 off, N > 0 a token budget, anything else
refused naming the key) and ``trainer.remove_microbatch_padding`` with its deprecated
alias ``trainer.use_sample_packing`` (SkyRL's name before 0.4.0): the alias reaches the
new key with a warning naming it, and the two set differently are refused naming both."""

from __future__ import annotations

import warnings

import pytest

from skyrl_train.config import PPOConfig, load_config, validate_cfg
from skyrl_train.config.sample_packing import resolve_sample_packing
from skyrl_train.errors import ConfigValidationError

KEY, ALIAS = "trainer.remove_microbatch_padding", "trainer.use_sample_packing"
BUDGET = "trainer.max_tokens_per_microbatch"


def _composed(overrides: list[str]) -> tuple[PPOConfig, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load_config(overrides)
    return cfg, [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]


def test_the_defaults_are_rows_packed_and_no_alias() -> None:
    cfg, warned = _composed([])
    t = cfg.trainer
    assert (t.max_tokens_per_microbatch, t.remove_microbatch_padding) == (-1, True)
    assert t.use_sample_packing is None and warned == []


@pytest.mark.parametrize("budget", [1, 4096])
def test_a_positive_token_budget_is_valid(budget: int) -> None:
    validate_cfg(load_config([f"{BUDGET}={budget}"]))


@pytest.mark.parametrize("bad", [0, -2, -4096])
def test_a_budget_neither_off_nor_positive_is_refused_naming_the_key(bad: int) -> None:
    cfg = load_config([f"{BUDGET}={bad}"])
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(cfg)
    assert info.value.path == BUDGET
    assert str(info.value).endswith(f"expected -1 or an int >= 1, got {bad}")
    assert cfg.trainer.micro_train_batch_size_per_gpu == 32  # the rest of it untouched


def test_a_string_budget_is_refused_at_composition_naming_the_key() -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_config([f"{BUDGET}=lots"])
    assert info.value.path == BUDGET


def test_under_a_token_budget_the_unused_row_count_is_not_refused() -> None:
    # 8 trajectories per rank do not divide by 5: refused by rows, unused by tokens.
    rows = ["trainer.micro_train_batch_size_per_gpu=5"]
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(load_config(rows))
    assert info.value.path == "trainer.micro_train_batch_size_per_gpu"
    validate_cfg(load_config([*rows, f"{BUDGET}=64"]))


@pytest.mark.parametrize("value", [True, False])
def test_the_old_name_reaches_the_new_key_with_a_warning(value: bool) -> None:
    cfg, warned = _composed([f"{ALIAS}={str(value).lower()}"])
    assert cfg.trainer.remove_microbatch_padding is value
    assert cfg.trainer.use_sample_packing is None  # read once, cleared
    assert len(warned) == 1
    assert f"{ALIAS} is deprecated: set {KEY} instead" in warned[0]
    validate_cfg(cfg)  # resolved already: validation leaves it as it is


def test_the_new_key_alone_gives_no_warning() -> None:
    cfg, warned = _composed([f"{KEY}=false"])
    assert cfg.trainer.remove_microbatch_padding is False and warned == []


def test_the_two_names_set_to_the_same_value_are_accepted() -> None:
    cfg, warned = _composed([f"{KEY}=false", f"{ALIAS}=false"])
    assert cfg.trainer.remove_microbatch_padding is False and len(warned) == 1


def test_the_two_names_set_differently_are_refused_naming_both() -> None:
    # The new key counts as set when it differs from its default (true).
    with pytest.raises(ConfigValidationError) as info:
        load_config([f"{KEY}=false", f"{ALIAS}=true"])
    assert info.value.path == ALIAS
    assert f"equal to {KEY} (false)" in info.value.reason
    assert str(info.value).endswith("got true")


def test_a_config_built_in_python_is_resolved_at_validation() -> None:
    cfg = PPOConfig()
    cfg.trainer.use_sample_packing = False
    with pytest.warns(FutureWarning, match=f"{ALIAS} is deprecated"):
        validate_cfg(cfg)
    assert cfg.trainer.remove_microbatch_padding is False
    assert cfg.trainer.use_sample_packing is None
    resolve_sample_packing(cfg)  # idempotent: nothing left to move
    conflicting = PPOConfig()
    conflicting.trainer.remove_microbatch_padding = False
    conflicting.trainer.use_sample_packing = True
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(conflicting)
    assert info.value.path == ALIAS
    # Refused as it came: neither key rewritten.
    assert conflicting.trainer.remove_microbatch_padding is False
    assert conflicting.trainer.use_sample_packing is True
