"""``POST /skyrl/v1/update_weights``: a safetensors body, checked before its data is read.

The whole body used to be read into memory first, up to a fixed 4 GiB: a 1 GiB garbage
upload grew the server from 388 MiB to 2.5 GiB. Now each step is bounded before it runs:

1. ``Content-Type: application/octet-stream`` (415), and a declared Content-Length
   within the model's own size (413): every parameter as F32 plus a header cap.
2. The 8-byte little-endian header length, capped by what a header naming every
   parameter once can need. Then the JSON header, checked whole against the engine's
   parameter shapes: each name known and given once, shape equal, dtype F16/BF16/F32,
   data offsets contiguous from 0 with exactly dtype size x numel bytes each, and a
   declared Content-Length equal to 8 + header + data. Any failure is a 400 naming the
   tensor or header field; no tensor data has been read then.
3. Under the app's weight lock (two uploads never interleave), the data section is
   streamed into one buffer of exactly the validated size, and the body must end there.
4. The engine's ``load_weights`` checks every value is finite in its dtype, then
   copies: all or nothing, so a refused upload leaves the old weights serving.

Policy versions and multi-upload commits (``X-Policy-Version``, ``X-Weight-Commit``):
``inference.server.weight_versions``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import StreamReader, hdrs, web

from inference.engine.base import DescribesWeights, InferenceEngine
from inference.errors import RequestValidationError
from inference.server.connections import Deadline, read_before
from inference.server.validation import check_content_type
from inference.server.weight_versions import (
    COMMIT_HEADER,
    POLICY_VERSION_HEADER,
    StagedWeights,
    UploadOutcome,
    check_version,
    engine_policy_version,
    parse_upload_headers,
)

__all__ = ["ACCEPTED_DTYPES", "TensorEntry", "parse_header", "receive_weights", "upload_caps"]

ACCEPTED_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
}
"""Floating dtypes a trainer sends; F64 would only double the size cap for no use."""
_WIDEST_BYTES = 4
MAX_HEADER_BYTES = 8 * 1024 * 1024
"""Absolute header cap; safetensors' own reader allows 100 MB, far past any real model."""
# A compact entry is `"<name>":{"dtype":"BF16","shape":[..],"data_offsets":[a,b]},`:
# ~70 bytes plus the name and ~12 per dim; doubled, so pretty-printed headers pass too.
_ENTRY_BYTES = 160
_DIM_BYTES = 24
_METADATA_BYTES = 64 * 1024
_READ_CHUNK = 1 << 20
"""Bytes per read of the data section: the only copy on top of the buffer itself."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Offset of its first byte in the data section."""
    end: int


def engine_shapes(engine: InferenceEngine) -> Mapping[str, tuple[int, ...]]:
    """The shapes ``engine.load_weights`` accepts, without copying any weight."""
    if isinstance(engine, DescribesWeights):
        return engine.parameter_shapes()
    raise web.HTTPNotImplemented(
        text=f"{type(engine).__name__} does not describe its weights (parameter_shapes)"
    )


def upload_caps(shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
    """``(header_cap, body_cap)`` in bytes for an engine with these parameter shapes."""
    header = _METADATA_BYTES + sum(
        _ENTRY_BYTES + 2 * len(name) + _DIM_BYTES * len(shape) for name, shape in shapes.items()
    )
    header = min(header, MAX_HEADER_BYTES)
    data = sum(math.prod(shape) for shape in shapes.values()) * _WIDEST_BYTES
    return header, 8 + header + data


async def receive_weights(
    request: web.Request,
    engine: InferenceEngine,
    *,
    lock: asyncio.Lock,
    staged: StagedWeights,
    header_deadline: Deadline,
    data_timeout_s: float,
) -> UploadOutcome:
    """Validates and streams one upload, then stages or loads it (module docstring)."""
    check_content_type(request.headers.get(hdrs.CONTENT_TYPE), "application/octet-stream")
    intent = parse_upload_headers(request)
    shapes = engine_shapes(engine)
    if intent.versioned and engine_policy_version(engine) is None:
        raise web.HTTPNotImplemented(
            text=f"{type(engine).__name__} keeps no policy version ({POLICY_VERSION_HEADER}, "
            f"{COMMIT_HEADER})"
        )
    header_cap, body_cap = upload_caps(shapes)
    declared = request.content_length
    if declared is not None and declared > body_cap:
        raise RequestValidationError(
            "Content-Length",
            f"at most {body_cap} bytes (this model's parameters as F32 plus a header)",
            declared,
            status=413,
        )
    content = request.content
    raw_length = await read_before(_exactly(content, 8), header_deadline)
    header_length = int.from_bytes(raw_length, "little")
    if not 2 <= header_length <= header_cap:
        raise RequestValidationError(
            "body.header_length",
            f"an int in [2, {header_cap}] (a header naming each of the engine's "
            f"{len(shapes)} parameters once fits)",
            header_length,
        )
    raw_header = await read_before(_exactly(content, header_length), header_deadline)
    entries = parse_header(raw_header, shapes)
    data_size = entries[-1].end
    total = 8 + header_length + data_size
    if declared is not None and declared != total:
        raise RequestValidationError(
            "Content-Length",
            f"{total} (8 + a {header_length}-byte header + {data_size} bytes of data)",
            declared,
        )
    async with lock:
        current = engine_policy_version(engine)
        if current is not None:
            check_version(intent, staged, current)
        # Allocated under the lock: concurrent uploads hold one buffer, not one each.
        buffer = torch.empty(data_size, dtype=torch.uint8)
        deadline = Deadline.after(
            asyncio.get_running_loop().time(),
            data_timeout_s,
            name="weight_read_timeout_s",
            since="taking the weight lock",
        )
        filled = await read_before(_read_into(content, buffer.numpy().data), deadline)
        if filled < data_size:
            short = next(e for e in entries if e.end > filled)
            raise RequestValidationError(
                f'body.header["{short.name}"].data_offsets',
                f"[{short.begin}, {short.end}] inside the body",
                f"a body whose data ends after {filled} bytes",
            )
        trailing = await read_before(content.read(1), deadline)
        if trailing:
            raise RequestValidationError(
                "body", f"the end of the body after {total} bytes", "more bytes"
            )
        named = [(e.name, _tensor(buffer, e)) for e in entries]
        if not intent.commit:
            staged.add(named, intent.policy_version)
            return UploadOutcome(0, len(staged), current)
        # In a thread: the engine loads between batches (its own model lock), and the
        # event loop must keep answering while a batch finishes.
        if intent.policy_version is None:
            count: int = await asyncio.to_thread(engine.load_weights, named)
        else:
            load = functools.partial(
                engine.load_weights, staged.take(named), policy_version=intent.policy_version
            )
            count = await asyncio.to_thread(load)
        return UploadOutcome(count, len(staged), engine_policy_version(engine))


def parse_header(raw: bytes, shapes: Mapping[str, tuple[int, ...]]) -> list[TensorEntry]:
    """The header's tensors in data order, or a ``RequestValidationError`` naming one."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except RequestValidationError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RequestValidationError(
            "body.header", "a UTF-8 JSON object", f"{type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(header, dict):
        raise RequestValidationError("body.header", "a JSON object", type(header).__name__)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise RequestValidationError("body.header.__metadata__", "an object of strings", metadata)
    if not header:
        raise RequestValidationError("body.header", "at least one tensor", "none")
    entries = sorted(
        (_entry(name, spec, shapes) for name, spec in header.items()),
        key=lambda e: (e.begin, e.end),
    )
    position, previous = 0, "the start of the data section"
    for entry in entries:
        if entry.begin != position:
            raise RequestValidationError(
                f'body.header["{entry.name}"].data_offsets',
                f"to start at {position}, where {previous} ends (contiguous, no overlap)",
                [entry.begin, entry.end],
            )
        position, previous = entry.end, repr(entry.name)
    return entries


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise RequestValidationError(f'body.header["{key}"]', "each key once", "a repeat")
        result[key] = value
    return result


def _entry(name: str, spec: Any, shapes: Mapping[str, tuple[int, ...]]) -> TensorEntry:
    if name not in shapes:
        example = next(iter(shapes), "")
        raise RequestValidationError(
            "body.header", f"names of engine parameters such as {example!r}", name
        )
    field = f'body.header["{name}"]'
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        got = sorted(spec) if isinstance(spec, dict) else spec
        raise RequestValidationError(field, "an object of dtype, shape, data_offsets", got)
    dtype = ACCEPTED_DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise RequestValidationError(
            f"{field}.dtype", f"a floating dtype, one of {sorted(ACCEPTED_DTYPES)}", spec["dtype"]
        )
    target = shapes[name]
    shape = spec["shape"]
    if not (isinstance(shape, list) and all(_is_int(d) for d in shape)) or tuple(shape) != target:
        raise RequestValidationError(f"{field}.shape", f"{list(target)}", shape)
    offsets = spec["data_offsets"]
    size = math.prod(target) * dtype.itemsize
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(o) and o >= 0 for o in offsets)
        and offsets[1] - offsets[0] == size
    ):
        raise RequestValidationError(
            f"{field}.data_offsets",
            f"[begin, begin + {size}] ({math.prod(target)} x {dtype.itemsize}-byte {spec['dtype']})",
            offsets,
        )
    return TensorEntry(name, dtype, target, offsets[0], offsets[1])


def _tensor(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    raw = buffer[entry.begin : entry.end]
    if entry.begin % entry.dtype.itemsize:
        # safetensors does not align offsets (a bf16 tensor of odd length shifts the
        # next f32 one by 2 bytes); torch views need element alignment, so copy it.
        raw = raw.clone()
    return raw.view(entry.dtype).reshape(entry.shape)


async def _exactly(content: StreamReader, n: int) -> bytes:
    try:
        return await content.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise RequestValidationError(
            "body", f"a safetensors file ({n} more bytes here)", f"{len(exc.partial)} bytes"
        ) from None


async def _read_into(content: StreamReader, view: memoryview) -> int:
    """Fills ``view`` from the body; returns the bytes read (fewer at the body's end)."""
    filled = 0
    while filled < len(view):
        chunk = await content.read(min(len(view) - filled, _READ_CHUNK))
        if not chunk:
            break
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return filled


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
