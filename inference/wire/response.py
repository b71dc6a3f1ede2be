"""Server side: write a generate response with packed envelopes (orjson + pybase64)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

import orjson

from inference.wire.fields import PackedField, pack_field

# orjson cannot write NaN/inf; a missing or non-finite sampled logprob becomes this
# floor, and the count is reported so a server can log or export it.
LOGPROB_FLOOR: Final = -9999.0

RAW_LOGPROBS: Final = "raw_logprobs"
PROCESSED_LOGPROBS: Final = "processed_logprobs"
LOGPROBS_MODES: Final = (RAW_LOGPROBS, PROCESSED_LOGPROBS)
"""What a reply's logprobs are (``sampling_params.logprobs_mode``, vLLM's names): log
softmax of the raw logits, or log q of the distribution the sampler draws from
(temperature, top-k, top-p; ``inference/engine/sampling.py``). Named here, beside the
reply's other logprob rule, so the engine and the torch-free clients share them."""

_BY_KEY: Final = {field.key: field for field in PackedField}


class ClampedLogprobs(NamedTuple):
    """``values`` with every missing/non-finite entry replaced by LOGPROB_FLOOR."""

    values: list[float]
    num_clamped: int


def clamp_logprobs(values: Iterable[float | None]) -> ClampedLogprobs:
    """Replace ``None``, NaN and +/-inf by -9999.0 and count them."""
    out: list[float] = []
    clamped = 0
    for value in values:
        if value is None or not math.isfinite(value):
            out.append(LOGPROB_FLOOR)
            clamped += 1
        else:
            out.append(float(value))
    return ClampedLogprobs(out, clamped)


def _pack_choice(choice: Mapping[str, Any], index: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in choice.items():
        if type(key) is not str:
            raise TypeError(f"$.choices[{index}]: keys must be plain str, got {key!r}")
        field = _BY_KEY.get(key)
        if field is not None and value is not None and not isinstance(value, Mapping):
            # An array or tensor for a registered key: pack it (canonical route
            # dtype, validated); an already packed envelope passes through.
            value = pack_field(field, value, path=f"$.choices[{index}].{key}")
        out[key] = value
    return out


def dumps_generate_response(
    choices: Sequence[Mapping[str, Any]], *, extra: Mapping[str, Any] | None = None
) -> bytes:
    """Serialise ``{"choices": [...], **extra}`` with registered fields as envelopes.

    Each choice keeps its key order; a value under a registered key
    (:class:`PackedField`) that is a numpy array or torch tensor is packed, data
    first. Everything else must already be JSON-able by orjson (clamp sampled
    logprobs with :func:`clamp_logprobs` first: orjson rejects NaN/inf).
    """
    body: dict[str, Any] = {"choices": [_pack_choice(c, i) for i, c in enumerate(choices)]}
    for key, value in (extra or {}).items():
        if key == "choices":
            raise ValueError("$.choices: expected extra keys other than choices, got 'choices'")
        body[key] = value
    return orjson.dumps(body)
