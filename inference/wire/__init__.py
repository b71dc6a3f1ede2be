"""Packed-ndarray wire codec for ``/skyrl/v1/generate`` (docs/design.md §2).

Arrays travel inside the JSON response as envelopes
``{"data": "<base64>", "shape": [...], "dtype": "<numpy name>", ...sidecar}``, data
first, so a client can splice the base64 out of the raw bytes without ever building
a huge Python ``str`` (:func:`load_packed_body`).

vLLM's replies carry routes in another form, a JSON string of base64 ``.npy`` bytes
(:class:`NpyField`, :func:`decode_npy_field`); the same scan splices both forms.

Every error here is an :class:`inference.errors.WireError` (a ``ValueError``) whose
message names the JSON path, what was expected and what arrived; a non-array or
non-mapping argument is a ``TypeError``.
"""

from inference.errors import WireError
from inference.wire.body import DEFAULT_FIELDS, load_packed_body
from inference.wire.fields import (
    ROUTE_DTYPES,
    FieldSpec,
    PackedField,
    decode_packed_field,
    decode_packed_fields,
    decode_packed_routed_experts,
    decode_packed_sample_support,
    pack_field,
    pack_routed_experts,
    pack_sample_support,
    route_dtype_for,
    route_filler,
)
from inference.wire.ndarray import PackedArrayKey, pack_ndarray, unpack_ndarray
from inference.wire.npy import NpyField, decode_npy_field
from inference.wire.response import (
    LOGPROB_FLOOR,
    LOGPROBS_MODES,
    PROCESSED_LOGPROBS,
    RAW_LOGPROBS,
    ClampedLogprobs,
    clamp_logprobs,
    dumps_generate_response,
)

__all__ = [
    "DEFAULT_FIELDS",
    "LOGPROBS_MODES",
    "LOGPROB_FLOOR",
    "PROCESSED_LOGPROBS",
    "RAW_LOGPROBS",
    "ROUTE_DTYPES",
    "ClampedLogprobs",
    "FieldSpec",
    "NpyField",
    "PackedArrayKey",
    "PackedField",
    "WireError",
    "clamp_logprobs",
    "decode_npy_field",
    "decode_packed_field",
    "decode_packed_fields",
    "decode_packed_routed_experts",
    "decode_packed_sample_support",
    "dumps_generate_response",
    "load_packed_body",
    "pack_field",
    "pack_ndarray",
    "pack_routed_experts",
    "pack_sample_support",
    "route_dtype_for",
    "route_filler",
    "unpack_ndarray",
]
