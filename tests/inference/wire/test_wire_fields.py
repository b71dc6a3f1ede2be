"""The packed-field registry: canonical route dtypes, sample support, torch input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference.errors import WireError
from inference.wire import (
    PackedField,
    decode_packed_fields,
    decode_packed_routed_experts,
    decode_packed_sample_support,
    pack_field,
    pack_ndarray,
    pack_routed_experts,
    pack_sample_support,
    route_dtype_for,
)

torch.set_num_threads(1)


def test_registry_entries() -> None:
    keys = {f.key: f for f in PackedField}
    assert set(keys) == {
        "routed_experts",
        "rollout_sample_support",
        "rollout_sample_support_logprobs",
        "rollout_sample_support_size",
        "packed_token_ids",
        "packed_logprobs",
    }
    assert keys["routed_experts"].spec.allowed_dtypes == ("uint8", "int16", "int32")
    assert keys["routed_experts"].spec.ndim == 3
    assert keys["packed_token_ids"].spec.allowed_dtypes == ("int32",)
    assert keys["packed_logprobs"].spec.ndim == 1
    assert PackedField.from_key("rollout_sample_support") is PackedField.ROLLOUT_SAMPLE_SUPPORT
    # Members are their JSON key and expose their spec directly.
    field = PackedField("routed_experts")
    assert field is PackedField.ROUTED_EXPERTS and field == "routed_experts"
    assert (field.allowed_dtypes, field.ndim) == (("uint8", "int16", "int32"), 3)
    with pytest.raises(WireError, match=r"\$\.r: expected non-negative expert ids"):
        field.validator(np.full((1, 1, 2), -1, np.int16), "$.r")
    sizes = PackedField.ROLLOUT_SAMPLE_SUPPORT_SIZE
    assert (sizes.allowed_dtypes, sizes.ndim) == (("int32",), 1)
    with pytest.raises(WireError, match=r"\$\.s: expected kept-set sizes >= 1, got 0"):
        sizes.validator(np.array([3, 0], np.int32), "$.s")


@pytest.mark.parametrize(
    ("max_id", "dtype"),
    [
        (0, "uint8"),
        (255, "uint8"),
        (256, "int16"),
        (32767, "int16"),
        (32768, "int32"),
        (2**31 - 1, "int32"),
    ],
)
def test_canonical_route_dtype_at_each_boundary(max_id: int, dtype: str) -> None:
    assert route_dtype_for(max_id) == np.dtype(dtype)
    routes = np.zeros((2, 3, 2), dtype=np.int64)
    routes[1, 2, 1] = max_id
    env = pack_routed_experts(routes)
    assert env["dtype"] == dtype
    out = decode_packed_routed_experts(env)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, routes)


def test_routes_above_int32_and_negative_are_refused() -> None:
    with pytest.raises(WireError, match=r"\$\.routed_experts: expected expert ids <= 2147483647"):
        pack_routed_experts(np.full((1, 1, 1), 2**31, dtype=np.int64))
    with pytest.raises(WireError, match="non-negative expert ids, got -1"):
        pack_routed_experts(np.full((1, 1, 1), -1, dtype=np.int64))
    env = pack_ndarray(np.full((1, 1, 2), -3, dtype=np.int16), allowed_dtypes=["int16"])
    with pytest.raises(WireError, match="non-negative expert ids, got -3"):
        decode_packed_routed_experts(env, path="$.choices[2].routed_experts")


@pytest.mark.parametrize("dtype", ["int16", "int32"])
@pytest.mark.parametrize("negative", [-1, -2, "min"])
def test_negative_ids_beside_a_large_max_are_refused(dtype: str, negative: int | str) -> None:
    # The one-pass check views ids as unsigned: a negative must not hide behind (or
    # be mistaken for) a large positive id, and the error names the smallest id.
    info = np.iinfo(dtype)
    low = info.min if negative == "min" else int(negative)
    routes = np.full((3, 2, 2), 300, dtype=dtype)
    routes[0, 0, 0] = info.max
    routes[2, 1, 1] = low
    env = pack_ndarray(routes, allowed_dtypes=[dtype])
    with pytest.raises(WireError, match=f"non-negative expert ids, got {low}") as err:
        decode_packed_routed_experts(env, path="$.choices[1].routed_experts")
    assert err.value.path == "$.choices[1].routed_experts"
    with pytest.raises(WireError, match=f"non-negative expert ids, got {low}"):
        pack_routed_experts(routes.astype(np.int64))


@pytest.mark.parametrize(
    ("source", "max_id", "wire"),
    [("uint16", 255, "uint8"), ("uint16", 300, "int16"), ("uint64", 2**31 - 1, "int32")],
)
def test_unsigned_input_is_packed_canonically(source: str, max_id: int, wire: str) -> None:
    routes = np.zeros((2, 1, 2), dtype=source)
    routes[1, 0, 1] = max_id
    env = pack_routed_experts(routes)
    assert env["dtype"] == wire
    np.testing.assert_array_equal(decode_packed_routed_experts(env), routes)
    with pytest.raises(WireError, match="expected expert ids <= 2147483647"):
        pack_routed_experts(np.full((1, 1, 1), 2**31, dtype=np.uint64))


def test_non_canonical_declared_dtype_is_refused() -> None:
    wide = pack_ndarray(np.full((2, 1, 1), 7, dtype=np.int32), allowed_dtypes=["int32"])
    with pytest.raises(WireError) as info:
        decode_packed_routed_experts(wide, path="$.choices[3].routed_experts")
    assert info.value.path == "$.choices[3].routed_experts.dtype"
    assert "canonical uint8 for max id 7" in str(info.value)
    empty = pack_ndarray(np.zeros((0, 2, 2), dtype=np.int16), allowed_dtypes=["int16"])
    with pytest.raises(WireError, match="canonical uint8"):
        decode_packed_routed_experts(empty)


def test_routes_reject_lists_floats_bools_and_wrong_rank() -> None:
    with pytest.raises(TypeError, match="numpy array or torch tensor"):
        pack_routed_experts([[[1, 2]]])
    with pytest.raises(WireError, match=r"\.dtype: expected an integer dtype, got 'float32'"):
        pack_routed_experts(np.zeros((1, 1, 1), np.float32))
    with pytest.raises(WireError, match="integer dtype, got 'bool'"):
        pack_routed_experts(np.zeros((1, 1, 1), bool))
    with pytest.raises(WireError, match=r"\.shape: expected 3 dims, got \[4, 2\]"):
        pack_routed_experts(np.zeros((4, 2), np.int64))


def test_routes_from_torch_tensors() -> None:
    t = torch.arange(24, dtype=torch.int64).reshape(2, 3, 4).transpose(0, 1)  # non-contiguous
    out = decode_packed_routed_experts(pack_routed_experts(t))
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, t.numpy())


def test_empty_routes_round_trip() -> None:
    env = pack_routed_experts(np.zeros((0, 48, 8), np.int64))
    assert env == {"data": "", "shape": [0, 48, 8], "dtype": "uint8"}
    assert decode_packed_routed_experts(env).shape == (0, 48, 8)


def test_sample_support_pair() -> None:
    ids = np.array([[5, 9, -1], [3, -1, -1], [1, 2, 4]], dtype=np.int64)
    lps = np.array([[-0.1, -2.0, -np.inf], [-0.01, -np.inf, -np.inf], [-1, -2, -3]])
    ids_env, lp_env = pack_sample_support(ids, lps)
    assert ids_env["dtype"] == "int32" and lp_env["dtype"] == "float32"
    out_ids, out_lps = decode_packed_sample_support(ids_env, lp_env, path="$.choices[0]")
    np.testing.assert_array_equal(out_ids, ids)
    np.testing.assert_array_equal(out_lps, lps.astype(np.float32))


@pytest.mark.parametrize(
    ("ids", "pattern"),
    [
        ([[5, -1, 9]], r"\[0\]: expected -1 padding only at the end of a row"),
        ([[1, 2], [-1, 3]], r"\[1\]: expected -1 padding only at the end"),
        ([[1, -2]], "token ids >= 0 or -1 padding, got -2"),
    ],
)
def test_sample_support_padding_is_trailing_only(ids: list, pattern: str) -> None:
    arr = np.array(ids, dtype=np.int64)
    with pytest.raises(WireError, match=pattern):
        pack_sample_support(arr, np.zeros(arr.shape))
    env = pack_ndarray(arr.astype(np.int32), allowed_dtypes=["int32"])
    with pytest.raises(WireError, match=pattern):
        decode_packed_fields({"rollout_sample_support": env})


def test_sample_support_shapes_must_match() -> None:
    with pytest.raises(WireError, match="rollout_sample_support_logprobs.shape: expected"):
        pack_sample_support(np.zeros((2, 3), np.int32), np.zeros((2, 4)))
    ids = pack_ndarray(np.zeros((2, 3), np.int32), allowed_dtypes=["int32"])
    lps = pack_ndarray(np.zeros((2, 4), np.float32), allowed_dtypes=["float32"])
    with pytest.raises(WireError, match=r"\$\.choices\[1\]\.rollout_sample_support_logprobs"):
        decode_packed_fields(
            {"rollout_sample_support": ids, "rollout_sample_support_logprobs": lps},
            path="$.choices[1]",
        )
    with pytest.raises(WireError, match="NaN"):
        pack_field(PackedField.ROLLOUT_SAMPLE_SUPPORT_LOGPROBS, np.full((1, 1), np.nan))


def test_packed_token_ids_and_logprobs() -> None:
    ids = pack_field(PackedField.PACKED_TOKEN_IDS, np.array([1, 2, 151_000]))
    lps = pack_field(PackedField.PACKED_LOGPROBS, torch.tensor([-0.5, -9999.0]))
    out = decode_packed_fields({"packed_token_ids": ids, "packed_logprobs": lps, "x": 1})
    assert out["packed_token_ids"].dtype == np.int32
    np.testing.assert_array_equal(out["packed_token_ids"], [1, 2, 151_000])
    np.testing.assert_array_equal(out["packed_logprobs"], np.array([-0.5, -9999.0], np.float32))
    with pytest.raises(WireError, match="finite logprobs"):
        pack_field(PackedField.PACKED_LOGPROBS, np.array([-np.inf]))
    with pytest.raises(WireError, match="non-negative token ids"):
        pack_field(PackedField.PACKED_TOKEN_IDS, np.array([-1]))
    with pytest.raises(WireError, match=r"packed_token_ids\.shape: expected 1 dims"):
        pack_field(PackedField.PACKED_TOKEN_IDS, np.zeros((1, 1), np.int32))


def test_decode_packed_fields_skips_absent_and_null() -> None:
    env = pack_routed_experts(np.ones((1, 1, 1), np.int64))
    out = decode_packed_fields({"routed_experts": env, "rollout_sample_support": None})
    assert list(out) == ["routed_experts"]
    assert decode_packed_fields({}) == {}
    with pytest.raises(TypeError, match="mapping choice"):
        decode_packed_fields([])  # type: ignore[arg-type]


def test_higher_rank_envelopes_are_refused() -> None:
    # [T, L, K, 1] routes and [T, k, 1] support hold exactly the right number of
    # bytes for [T, L, K] and [T, k]: the declared rank alone must refuse them.
    routes = pack_ndarray(np.ones((4, 3, 2, 1), np.uint8), allowed_dtypes=["uint8"])
    with pytest.raises(WireError) as info:
        decode_packed_routed_experts(routes, path="$.choices[2].routed_experts")
    assert info.value.path == "$.choices[2].routed_experts.shape"
    assert "expected 3 dims, got [4, 3, 2, 1]" in str(info.value)
    ids = pack_ndarray(np.ones((4, 3, 1), np.int32), allowed_dtypes=["int32"])
    lps = pack_ndarray(np.zeros((4, 3, 1), np.float32), allowed_dtypes=["float32"])
    with pytest.raises(WireError) as info:
        decode_packed_sample_support(ids, lps, path="$.choices[1]")
    assert info.value.path == "$.choices[1].rollout_sample_support.shape"
    with pytest.raises(WireError) as info:
        decode_packed_fields({"rollout_sample_support_logprobs": lps}, path="$.choices[0]")
    assert info.value.path == "$.choices[0].rollout_sample_support_logprobs.shape"
