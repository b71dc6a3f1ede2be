"""The ``.npy`` string form of a packed field: a JSON string holding base64 ``.npy`` bytes.

vLLM sends ``choices[i].routed_experts`` this way (``np.save`` of a ``[tokens, layers,
top_k]`` array, base64 as a plain JSON string) where our own server sends an envelope.
:func:`load_packed_body` splices both forms out of the raw body in the same single
scan; this module is the form's registry (:class:`NpyField`, one entry per field) and
its decoder.

The ``.npy`` header is parsed here, never by ``np.load``: it is untrusted text, and the
decoder accepts exactly what ``np.save`` writes for an allowed dtype (magic, version
1.0/2.0/3.0, a ``{'descr', 'fortran_order', 'shape'}`` dict, C order, little-endian,
the data filling the rest to the byte). Everything else is a :class:`WireError`
naming the JSON path; pickled (object) arrays are refused by the dtype check before
any byte of data is looked at.
"""

from __future__ import annotations

import ast
import binascii
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

import numpy as np
import pybase64

from inference.errors import WireError
from inference.wire.fields import INT32_MAX, route_dtype_for

NPY_MAGIC: Final = b"\x93NUMPY"
# A 3-D header is ~120 bytes (np.save pads it to a multiple of 64); numpy's own reader
# stops at 10000. 4 KiB bounds what ast.literal_eval is ever handed.
MAX_HEADER_BYTES: Final = 4096
_HEADER_KEYS: Final = frozenset(("descr", "fortran_order", "shape"))
# version -> (struct format of the header length, its size, header text encoding)
_VERSIONS: Final = {
    (1, 0): ("<H", 2, "latin1"),
    (2, 0): ("<I", 4, "latin1"),
    (3, 0): ("<I", 4, "utf8"),
}

Finisher = Callable[[np.ndarray, str], np.ndarray]


@dataclass(frozen=True)
class NpyFieldSpec:
    """How one field in the ``.npy`` form is checked; the value of an :class:`NpyField`."""

    key: str
    allowed_dtypes: tuple[str, ...]
    """numpy names; on the wire always little-endian (``|u1``, ``<u2``, ``<i4``)."""
    ndim: int
    finish: Finisher
    """``finish(array, path)``: validate the values and return the array the project
    uses (e.g. routes in the canonical ``ROUTE_DTYPES`` dtype); raises WireError."""


def _canonical_routes(arr: np.ndarray, path: str) -> np.ndarray:
    """Routes in the project's canonical dtype, so traces and collation take them as
    they take the builtin server's. vLLM picks uint8 up to 256 experts, else uint16 (by
    expert count, not by the largest id); some versions send int32."""
    if arr.dtype == np.uint8:
        return arr  # canonical for any content, and cannot be negative: no pass
    if not arr.size:
        return arr.astype(np.uint8)
    low, high = int(arr.min()), int(arr.max())
    if low < 0:
        raise WireError(path, "non-negative expert ids", low)
    if high > INT32_MAX:  # unreachable for uint16/int32; kept for a wider allowed dtype
        raise WireError(path, f"expert ids <= {INT32_MAX}", high)
    return arr.astype(route_dtype_for(high), copy=False)


class NpyField(Enum):
    """Registry of fields sent in the ``.npy`` string form (``choices[i].<key>``: a
    base64 ``.npy`` string or null). Adding one is one entry; the body scan and the
    decoder are shared. Pass members to :func:`load_packed_body`'s ``fields``."""

    # vLLM's [num_tokens - 1 - prompt_start, layers, top_k] expert ids.
    ROUTED_EXPERTS = NpyFieldSpec(
        "routed_experts", ("uint8", "uint16", "int32"), 3, _canonical_routes
    )

    @property
    def key(self) -> str:
        return self.value.key

    @property
    def spec(self) -> NpyFieldSpec:
        return self.value


def _descr(name: str) -> str:
    return np.dtype(name).newbyteorder("<").str


def _b64decode(data: Any, path: str) -> bytearray:
    if not isinstance(data, str | bytes | bytearray | memoryview):
        raise WireError(path, "a base64 .npy string", type(data).__name__)
    try:
        # validate=True: strict alphabet and padding, and pybase64's fast path. A
        # memoryview into the raw body decodes with no intermediate str or bytes.
        return pybase64.b64decode_as_bytearray(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        preview = data[:40] if isinstance(data, str) else bytes(data[:40])
        raise WireError(path, f"strict padded base64 ({exc})", preview) from None


def _parse_header(buf: bytearray, path: str) -> tuple[str, Any, Any, int]:
    """(descr, fortran_order, shape, data offset) of a ``.npy`` buffer, unvalidated values."""
    if bytes(buf[: len(NPY_MAGIC)]) != NPY_MAGIC:
        raise WireError(path, "a .npy payload (magic \\x93NUMPY)", bytes(buf[:8]))
    version = tuple(buf[6:8])
    if version not in _VERSIONS:
        raise WireError(f"{path}.version", "a .npy format version 1.0, 2.0 or 3.0", version)
    fmt, size, encoding = _VERSIONS[version]  # type: ignore[index]
    prefix = 8 + size
    if len(buf) < prefix:
        raise WireError(path, f"a .npy prefix of {prefix} bytes", f"{len(buf)} bytes")
    (header_len,) = struct.unpack_from(fmt, buf, 8)
    if header_len > MAX_HEADER_BYTES:
        raise WireError(
            f"{path}.header", f"a .npy header of at most {MAX_HEADER_BYTES} bytes", header_len
        )
    offset = prefix + header_len
    if len(buf) < offset:
        raise WireError(
            f"{path}.header", f"{header_len} header bytes", f"{len(buf) - prefix} (truncated)"
        )
    try:
        text = bytes(buf[prefix:offset]).decode(encoding)
        header = ast.literal_eval(text)
    except (UnicodeDecodeError, ValueError, SyntaxError, MemoryError, RecursionError):
        raise WireError(
            f"{path}.header", "a .npy header dict literal", bytes(buf[prefix:offset])[:80]
        ) from None
    if type(header) is not dict or set(header) != _HEADER_KEYS:
        got = sorted(map(str, header)) if type(header) is dict else type(header).__name__
        raise WireError(f"{path}.header", f"a dict with keys {sorted(_HEADER_KEYS)}", got)
    return header["descr"], header["fortran_order"], header["shape"], offset


def _check_shape(
    shape: Any, expected: Sequence[int | None] | None, ndim: int, path: str
) -> tuple[int, ...]:
    if type(shape) is not tuple:
        raise WireError(f"{path}.shape", "a tuple of non-negative ints", shape)
    if len(shape) != ndim:
        raise WireError(f"{path}.shape", f"{ndim} dims", list(shape))
    for i, dim in enumerate(shape):
        if type(dim) is not int or dim < 0:  # bool is an int subclass: refused too
            raise WireError(f"{path}.shape[{i}]", "a non-negative int", dim)
    if expected is not None:
        for i, (dim, want) in enumerate(zip(shape, expected, strict=True)):
            if want is not None and dim != want:
                raise WireError(
                    f"{path}.shape[{i}]", f"{want} (expected shape {list(expected)})", dim
                )
    return shape


def decode_npy_field(
    field: NpyField,
    data: Any,
    *,
    path: str = "",
    shape: Sequence[int | None] | None = None,
) -> np.ndarray:
    """Decode one base64 ``.npy`` string (str, bytes or a memoryview into the raw body).

    ``shape``, when given, is the expected shape with ``None`` for a dim that may be
    anything (e.g. ``(rows, layers, top_k)`` or ``(None, layers, top_k)``). Checks,
    each a :class:`WireError` naming ``path``: strict base64, ``.npy`` magic and
    version, a bounded header dict, dtype allowed (little-endian; object/pickle
    refused), C order, rank, the expected dims, and data bytes equal to
    ``prod(shape) * itemsize`` exactly. Then the field's ``finish`` (value checks and
    the project's dtype). The array is writable (a view of the decoded buffer, or a converted copy).
    """
    spec = field.spec
    path = path or f"$.{spec.key}"
    if shape is not None and len(shape) != spec.ndim:
        raise ValueError(f"shape: expected {spec.ndim} dims (None for any), got {list(shape)}")
    buf = _b64decode(data, path)
    descr, fortran_order, raw_shape, offset = _parse_header(buf, path)
    allowed = {_descr(name): name for name in spec.allowed_dtypes}
    if type(descr) is not str or descr not in allowed:
        raise WireError(f"{path}.dtype", f"one of {sorted(allowed)} (.npy descr)", descr)
    if fortran_order is not False:
        raise WireError(f"{path}.fortran_order", "False (C order)", fortran_order)
    dims = _check_shape(raw_shape, shape, spec.ndim, path)
    dtype = np.dtype(descr)
    count = 1
    for dim in dims:
        count *= dim  # Python ints: a hostile shape cannot overflow the check
    need = count * dtype.itemsize
    if len(buf) - offset != need:
        raise WireError(
            f"{path}.data",
            f"{need} bytes for shape {list(dims)} {allowed[descr]}",
            f"{len(buf) - offset} bytes",
        )
    # numpy reads "<u2" on a little-endian host as the native "uint16"; elsewhere the
    # finisher's astype makes it native.
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(dims)
    return spec.finish(arr, path)


def encode_npy(arr: np.ndarray) -> str:
    """Base64 ``.npy`` of ``arr`` as ``np.save`` writes it (tests and fake servers)."""
    import io

    with io.BytesIO() as out:
        np.save(out, arr, allow_pickle=False)
        return pybase64.b64encode(out.getbuffer()).decode("ascii")
