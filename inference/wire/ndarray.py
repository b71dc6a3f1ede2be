"""One NumPy array <-> one JSON envelope ``{"data", "shape", "dtype", ...sidecar}``.

The envelope's keys come in exactly this order, data first: the client finds the
base64 by scanning for ``{"data": "`` right after a registered key, so a writer
that put ``shape`` first would leave its blob unspliced (an error, not a slow path).
"""

from __future__ import annotations

import binascii
import sys
from collections.abc import Collection, Mapping
from enum import Enum
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import pybase64

from inference.errors import WireError

DTypeLike = npt.DTypeLike


class PackedArrayKey(str, Enum):
    """The envelope's own keys, in wire order (data first, so a byte scan finds the
    base64 right after the field name). Members compare equal to their key; write
    ``.value`` (a plain ``str``) into dicts, since orjson refuses ``str`` subclasses
    as keys."""

    DATA = "data"
    SHAPE = "shape"
    DTYPE = "dtype"


_DATA: Final = PackedArrayKey.DATA.value
_SHAPE: Final = PackedArrayKey.SHAPE.value
_DTYPE: Final = PackedArrayKey.DTYPE.value
_ENVELOPE_KEYS: Final = frozenset((_DATA, _SHAPE, _DTYPE))


def dtype_names(allowed_dtypes: Collection[DTypeLike]) -> frozenset[str]:
    """Normalise ``("uint8", np.int16, np.dtype("f4"))`` to numpy names."""
    return frozenset(np.dtype(d).name for d in allowed_dtypes)


def _little_endian(dtype: np.dtype[Any]) -> np.dtype[Any]:
    # The wire is little-endian whatever the host; on a little-endian host this is
    # the native dtype (numpy swaps nothing, and arrays print as plain "int32").
    return dtype.newbyteorder("=" if sys.byteorder == "little" else "<")


def pack_ndarray(
    arr: np.ndarray,
    *,
    allowed_dtypes: Collection[DTypeLike],
    extra: Mapping[str, Any] | None = None,
    path: str = "$",
) -> dict[str, Any]:
    """Encode ``arr`` as an envelope: C-contiguous little-endian bytes, padded base64.

    ``extra`` adds sidecar keys after the envelope keys; a sidecar key that collides
    with ``data``/``shape``/``dtype`` or is not a plain ``str`` is a :class:`WireError`.
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{path}: expected a numpy.ndarray, got {type(arr).__name__}")
    allowed = dtype_names(allowed_dtypes)
    if arr.dtype.name not in allowed:
        raise WireError(f"{path}.dtype", f"one of {sorted(allowed)}", arr.dtype.name)
    wire_dtype = _little_endian(arr.dtype)
    # ascontiguousarray copies only non-contiguous (sliced, transposed) input.
    data = np.ascontiguousarray(arr, dtype=wire_dtype)
    envelope: dict[str, Any] = {
        _DATA: pybase64.b64encode_as_string(data.data),
        _SHAPE: [int(d) for d in arr.shape],
        _DTYPE: arr.dtype.name,
    }
    for key, value in (extra or {}).items():
        if type(key) is not str:
            raise WireError(f"{path}.<sidecar>", "a plain str key", key)
        if key in _ENVELOPE_KEYS:
            raise WireError(f"{path}.{key}", "a sidecar key other than data/shape/dtype", key)
        envelope[key] = value
    return envelope


def _check_shape(shape: Any, *, ndim: int | None, path: str) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple):
        raise WireError(f"{path}.shape", "a list of non-negative ints", shape)
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"{path}.shape", f"{ndim} dims", shape)
    for i, dim in enumerate(shape):
        # bool is an int subclass and 2.0 == 2: both mean a broken writer.
        if type(dim) is not int or dim < 0:
            raise WireError(f"{path}.shape[{i}]", "a non-negative int", dim)
    return tuple(shape)


def decode_base64(data: Any, *, path: str) -> bytearray:
    """Strict padded base64 (``validate=True`` is also pybase64's fast path) to a
    fresh writable buffer. ``data`` may be ``str``, ``bytes`` or a memoryview."""
    if not isinstance(data, str | bytes | bytearray | memoryview):
        raise WireError(f"{path}.data", "a base64 str or bytes", type(data).__name__)
    try:
        return pybase64.b64decode_as_bytearray(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        preview = bytes(data[:40]) if not isinstance(data, str) else data[:40]
        raise WireError(f"{path}.data", f"strict padded base64 ({exc})", preview) from None


def unpack_ndarray(
    payload: Mapping[str, Any],
    *,
    allowed_dtypes: Collection[DTypeLike],
    ndim: int | None,
    path: str = "$",
) -> tuple[np.ndarray, dict[str, Any]]:
    """Decode an envelope into a writable array and its sidecar keys.

    ``ndim=None`` accepts any rank. Checks, each a :class:`WireError` naming the
    path: dtype allowed, shape a list of non-negative ints of rank ``ndim``, strict
    base64, and byte count equal to ``prod(shape) * itemsize``.
    """
    if not isinstance(payload, Mapping):
        raise TypeError(f"{path}: expected a mapping envelope, got {type(payload).__name__}")
    for key in (_DATA, _SHAPE, _DTYPE):
        if key not in payload:
            raise WireError(f"{path}.{key}", "an envelope key", f"keys {list(payload)}")
    allowed = dtype_names(allowed_dtypes)
    dtype_name = payload[_DTYPE]
    if not isinstance(dtype_name, str) or dtype_name not in allowed:
        raise WireError(f"{path}.dtype", f"one of {sorted(allowed)}", dtype_name)
    shape = _check_shape(payload[_SHAPE], ndim=ndim, path=path)
    dtype = _little_endian(np.dtype(dtype_name))
    buf = decode_base64(payload[_DATA], path=path)
    count = 1
    for dim in shape:
        count *= dim  # Python ints: a hostile shape cannot overflow the check
    if len(buf) != count * dtype.itemsize:
        raise WireError(
            f"{path}.data",
            f"{count * dtype.itemsize} bytes for shape {list(shape)} {dtype_name}",
            f"{len(buf)} bytes",
        )
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    sidecar = {k: v for k, v in payload.items() if k not in _ENVELOPE_KEYS}
    return arr, sidecar
