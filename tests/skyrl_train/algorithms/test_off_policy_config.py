"""The off-policy correction's keys: schema ranges, the launch rules of
``config.off_policy`` (old and new spellings must agree; fully-async needs an
importance weight), and the mapping of ``use_tis`` onto the new keys."""

from __future__ import annotations

import dataclasses

import pytest

from skyrl_train.algorithms import OffPolicyCorrection
from skyrl_train.config import check_constraints, load_config
from skyrl_train.config.off_policy import (
    check_fully_async_correction,
    check_off_policy_correction,
    corrects_off_policy,
    effective_correction,
)
from skyrl_train.config.schema import OffPolicyCorrectionConfig
from skyrl_train.errors import ConfigValidationError

A = "trainer.algorithm"
C = f"{A}.off_policy_correction"


def _refusal(check, overrides: list[str]) -> ConfigValidationError:
    with pytest.raises(ConfigValidationError) as info:
        check(load_config(overrides))
    assert str(info.value).startswith(info.value.path + ": expected ")
    return info.value


def test_settings_mirror_the_config_node() -> None:
    # OffPolicyCorrection is built from the node field by field (from_algorithm_config):
    # a key added to one and not the other, or a default that drifts, shows here.
    node = {f.name: f.default for f in dataclasses.fields(OffPolicyCorrectionConfig)}
    settings = {f.name: f.default for f in dataclasses.fields(OffPolicyCorrection)}
    assert node == settings
    assert settings["token_tis_ratio_clip_high"] == 2.0  # SkyRL's defaults
    assert settings["sequence_tis_ratio_clip_high"] == 5.0
    assert (settings["geo_mask_low"], settings["geo_mask_high"]) == (0.99, 1.01)
    assert (settings["product_mask_low"], settings["product_mask_high"]) == (0.5, 2.0)


def test_defaults_correct_nothing_and_pass() -> None:
    cfg = load_config()
    check_off_policy_correction(cfg)
    check_fully_async_correction(cfg)
    assert not effective_correction(cfg).enabled
    assert not corrects_off_policy(cfg)


def test_use_tis_is_token_tis_at_its_cap() -> None:
    cfg = load_config([f"{A}.use_tis=true", f"{A}.tis_imp_ratio_cap=3.0"])
    check_off_policy_correction(cfg)  # token_tis_ratio_clip_high (2.0) is unused here
    assert effective_correction(cfg) == OffPolicyCorrection(
        tis_ratio_type="token", token_tis_ratio_clip_high=3.0
    )
    assert corrects_off_policy(cfg)
    # Both spellings saying the same thing is fine.
    same = load_config(
        [f"{A}.use_tis=true", f"{A}.tis_imp_ratio_cap=3.0", f"{C}.tis_ratio_type=token"]
        + [f"{C}.token_tis_ratio_clip_high=3.0"]
    )
    check_off_policy_correction(same)
    assert effective_correction(same) == effective_correction(cfg)


def test_use_tis_beside_sequence_tis_is_refused() -> None:
    err = _refusal(
        check_off_policy_correction, [f"{A}.use_tis=true", f"{C}.tis_ratio_type=sequence"]
    )
    assert err.path == f"{A}.use_tis"
    assert "'sequence'" in str(err) and err.got == "true"


def test_use_tis_beside_another_token_clip_is_refused() -> None:
    err = _refusal(
        check_off_policy_correction,
        [f"{A}.use_tis=true", f"{C}.tis_ratio_type=token", f"{C}.token_tis_ratio_clip_high=3.0"],
    )
    assert err.path == f"{A}.use_tis"
    assert "3.0" in str(err) and "tis_imp_ratio_cap, 2.0" in str(err)


@pytest.mark.parametrize(
    "correction",
    [[f"{A}.use_tis=true"], [f"{C}.tis_ratio_type=token"], [f"{C}.tis_ratio_type=sequence"]],
)
def test_fully_async_accepts_any_importance_weight(correction: list[str]) -> None:
    check_fully_async_correction(load_config(["trainer.fully_async.enabled=true", *correction]))


@pytest.mark.parametrize(
    "correction",
    [[], [f"{C}.sequence_mask_metric=geometric"], [f"{C}.outlier_token_is_threshold_high=100"]],
)
def test_fully_async_without_an_importance_weight_is_refused(correction: list[str]) -> None:
    err = _refusal(check_fully_async_correction, ["trainer.fully_async.enabled=true", *correction])
    assert err.path == f"{C}.tis_ratio_type"
    assert "use_tis" in str(err) and err.got == "null"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (f"{C}.tis_ratio_type=tokens", f"{C}.tis_ratio_type"),
        (f"{C}.sequence_mask_metric=mean", f"{C}.sequence_mask_metric"),
        (f"{C}.token_tis_ratio_clip_high=0", f"{C}.token_tis_ratio_clip_high"),
        (f"{C}.sequence_tis_ratio_clip_high=-1", f"{C}.sequence_tis_ratio_clip_high"),
        # Every window must hold ratio 1: an on-policy sequence is never masked.
        (f"{C}.product_mask_low=1.5", f"{C}.product_mask_low"),
        (f"{C}.product_mask_high=0.9", f"{C}.product_mask_high"),
        (f"{C}.geo_mask_low=1.001", f"{C}.geo_mask_low"),
        (f"{C}.geo_mask_high=0.999", f"{C}.geo_mask_high"),
        (f"{C}.outlier_token_is_threshold_low=2", f"{C}.outlier_token_is_threshold_low"),
        (f"{C}.outlier_token_is_threshold_high=0.5", f"{C}.outlier_token_is_threshold_high"),
        (f"{C}.token_mask_is_threshold_low=0", f"{C}.token_mask_is_threshold_low"),
        (f"{C}.token_mask_is_threshold_high=-1", f"{C}.token_mask_is_threshold_high"),
    ],
)
def test_schema_ranges_name_the_key(override: str, key: str) -> None:
    err = _refusal(check_constraints, [override])
    assert err.path == key


def test_settings_a_launch_accepts_build() -> None:
    cfg = load_config(
        [
            f"{C}.tis_ratio_type=sequence",
            f"{C}.sequence_mask_metric=geometric",
            f"{C}.geo_mask_low=0.9",
            f"{C}.outlier_token_is_threshold_low=1e-4",
            f"{C}.outlier_token_is_threshold_high=100",
        ]
    )
    check_constraints(cfg)
    check_off_policy_correction(cfg)
    got = effective_correction(cfg)
    assert got.enabled and got.tis_ratio_type == "sequence" and got.geo_mask_low == 0.9
    assert got.outlier_token_is_threshold_low == 1e-4


@pytest.mark.parametrize(
    ("overrides", "key", "got"),
    [
        # One bound alone: SkyRL ignores it (the mask needs both); refused, naming the other.
        ([f"{C}.token_mask_is_threshold_low=0.5"], "token_mask_is_threshold_high", "null"),
        ([f"{C}.token_mask_is_threshold_high=2"], "token_mask_is_threshold_low", "null"),
        (
            [f"{C}.token_mask_is_threshold_low=2", f"{C}.token_mask_is_threshold_high=2"],
            "token_mask_is_threshold_low",
            "2.0",
        ),
    ],
)
def test_a_token_band_with_one_bound_or_none_between_is_refused(
    overrides: list[str], key: str, got: str
) -> None:
    err = _refusal(check_off_policy_correction, overrides)
    assert err.path == f"{C}.{key}" and err.got == got


@pytest.mark.parametrize("band", [("0.5", "2"), ("1.5", "3")], ids=["holds-1", "excludes-1"])
def test_a_token_band_with_both_bounds_is_a_correction(band: tuple[str, str]) -> None:
    # As in SkyRL the band need not hold 1 (placeholders are never dropped by it:
    # test_token_mask.py); both null, the default, is no token mask.
    low, high = band
    cfg = load_config(
        [f"{C}.token_mask_is_threshold_low={low}", f"{C}.token_mask_is_threshold_high={high}"]
    )
    check_constraints(cfg)
    check_off_policy_correction(cfg)
    got = effective_correction(cfg)
    assert got.enabled and not corrects_off_policy(cfg)  # a mask weighs no token
    assert (got.token_mask_is_threshold_low, got.token_mask_is_threshold_high) == (
        float(low),
        float(high),
    )
    assert load_config().trainer.algorithm.off_policy_correction.token_mask_is_threshold_low is None
