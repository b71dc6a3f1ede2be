"""pack_ndarray / unpack_ndarray: round trips and every bad-input path."""

from __future__ import annotations

import numpy as np
import pybase64
import pytest

from inference.errors import WireError
from inference.wire import PackedArrayKey, pack_ndarray, unpack_ndarray

INTS = ("uint8", "int16", "int32")


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(24, dtype=np.int32).reshape(2, 3, 4),
        np.arange(24, dtype=np.int32).reshape(2, 3, 4)[:, ::2, ::-1],  # non-contiguous
        np.arange(12, dtype=np.int16).reshape(3, 4).T,  # Fortran order
        np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian input goes out little-endian
        np.zeros((0, 48, 8), dtype=np.uint8),  # empty
        np.zeros((3, 0), dtype=np.int32),
    ],
)
def test_round_trip_any_layout(arr: np.ndarray) -> None:
    env = pack_ndarray(arr, allowed_dtypes=INTS)
    assert list(env)[:3] == [k.value for k in PackedArrayKey] == ["data", "shape", "dtype"]
    assert all(type(k) is str for k in env)  # orjson refuses str subclasses as keys
    assert env["shape"] == list(arr.shape)
    assert env["dtype"] == arr.dtype.name
    out, sidecar = unpack_ndarray(env, allowed_dtypes=INTS, ndim=arr.ndim)
    assert sidecar == {}
    np.testing.assert_array_equal(out, arr)
    assert out.flags.c_contiguous and out.flags.writeable
    out[...] = 0  # decoded arrays are writable copies


def test_bytes_are_little_endian_c_order() -> None:
    env = pack_ndarray(np.array([[1, 2], [3, 4]], dtype=np.int16).T, allowed_dtypes=["int16"])
    assert pybase64.b64decode(env["data"]) == bytes([1, 0, 3, 0, 2, 0, 4, 0])


@pytest.mark.parametrize("kind", [str, bytes, memoryview])
def test_data_may_be_str_bytes_or_memoryview(kind: type) -> None:
    env = pack_ndarray(np.arange(5, dtype=np.float32), allowed_dtypes=["float32"])
    data = env["data"] if kind is str else kind(env["data"].encode())
    out, _ = unpack_ndarray({**env, "data": data}, allowed_dtypes=["float32"], ndim=1)
    np.testing.assert_array_equal(out, np.arange(5, dtype=np.float32))


def test_sidecar_round_trip_and_collisions() -> None:
    env = pack_ndarray(np.arange(3, dtype=np.uint8), allowed_dtypes=INTS, extra={"start": 7})
    assert list(env) == ["data", "shape", "dtype", "start"]
    _, sidecar = unpack_ndarray(env, allowed_dtypes=INTS, ndim=1)
    assert sidecar == {"start": 7}
    for key in ("data", "shape", "dtype"):
        with pytest.raises(WireError, match=rf"\$\.{key}: expected a sidecar key"):
            pack_ndarray(np.arange(3, dtype=np.uint8), allowed_dtypes=INTS, extra={key: 1})


def test_non_array_and_non_mapping_are_type_errors() -> None:
    with pytest.raises(TypeError, match="numpy.ndarray"):
        pack_ndarray([1, 2, 3], allowed_dtypes=INTS)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping"):
        unpack_ndarray(["AAA="], allowed_dtypes=INTS, ndim=1)  # type: ignore[arg-type]


def test_disallowed_dtype_both_ways() -> None:
    with pytest.raises(WireError, match=r"\$\.x\.dtype: expected one of .*got 'float64'"):
        pack_ndarray(np.zeros(2), allowed_dtypes=INTS, path="$.x")
    env = pack_ndarray(np.zeros(2, np.int64), allowed_dtypes=["int64"])
    with pytest.raises(WireError, match=r"\$\.dtype: expected one of"):
        unpack_ndarray(env, allowed_dtypes=INTS, ndim=1)


def _env(**over: object) -> dict[str, object]:
    env = pack_ndarray(np.arange(6, dtype=np.int32).reshape(2, 3), allowed_dtypes=["int32"])
    env.update(over)
    return env


@pytest.mark.parametrize(
    ("over", "field", "pattern"),
    [
        ({"shape": [2, True]}, "shape[1]", "non-negative int"),
        ({"shape": [2.0, 3]}, "shape[0]", "non-negative int"),
        ({"shape": [-2, -3]}, "shape[0]", "non-negative int"),
        ({"shape": [6]}, "shape", "2 dims"),
        ({"shape": "2,3"}, "shape", "list of non-negative ints"),
        ({"shape": [3, 3]}, "data", "36 bytes for shape"),  # byte count mismatch
        ({"dtype": 5}, "dtype", "one of"),
        ({"data": "AAAA!AAA"}, "data", "strict padded base64"),
        ({"data": "AAAAAQAAAAIAAAADAAAABAAAAAUAAAA"}, "data", "strict padded base64"),  # truncated
        ({"data": "AAAAAQAA"}, "data", "bytes for shape"),  # truncated buffer, valid base64
        ({"data": 17}, "data", "base64 str or bytes"),
    ],
)
def test_bad_envelopes_name_the_field(over: dict, field: str, pattern: str) -> None:
    with pytest.raises(WireError) as info:
        unpack_ndarray(_env(**over), allowed_dtypes=["int32"], ndim=2, path="$.choices[3].x")
    assert info.value.path == f"$.choices[3].x.{field}"
    assert pattern in str(info.value)
    assert str(info.value).startswith(f"$.choices[3].x.{field}: expected ")


def test_missing_envelope_key() -> None:
    env = _env()
    del env["shape"]
    with pytest.raises(WireError, match=r"\$\.shape: expected an envelope key"):
        unpack_ndarray(env, allowed_dtypes=["int32"], ndim=2)


def test_wire_error_is_a_value_error() -> None:
    assert issubclass(WireError, ValueError)


@pytest.mark.parametrize("shape", [[2, 3, 1], [1, 2, 3], [2, 3, 1, 1]])
def test_higher_rank_than_declared_is_refused(shape: list[int]) -> None:
    # Same element count, so the byte check passes: only the rank check can refuse it.
    with pytest.raises(WireError) as info:
        unpack_ndarray(_env(shape=shape), allowed_dtypes=["int32"], ndim=2, path="$.x")
    assert info.value.path == "$.x.shape"
    assert f"expected 2 dims, got {shape}" in str(info.value)


@pytest.mark.parametrize(("shape", "need"), [([2, 2], 16), ([1, 3], 12), ([0, 3], 0)])
def test_too_many_bytes_is_a_wire_error(shape: list[int], need: int) -> None:
    # 24 bytes of data for fewer elements: a WireError naming .data, not numpy's
    # bare "cannot reshape" ValueError.
    with pytest.raises(WireError) as info:
        unpack_ndarray(_env(shape=shape), allowed_dtypes=["int32"], ndim=2, path="$.x")
    assert info.value.path == "$.x.data"
    assert f"expected {need} bytes for shape {shape} int32, got '24 bytes'" in str(info.value)
