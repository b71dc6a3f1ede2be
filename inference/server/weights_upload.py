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

Policy versions and multi-upload commits
----------------------------------------
A trainer's push may span several uploads (buckets); two request headers make it land
as one step, and tag what the engine then generates (``policy_version`` in every
generate reply and in ``/health``):

``X-Policy-Version: <int >= 0>``
    The policy version the weights are. On the committing upload the engine's version
    becomes it in the same model-locked step as the copy: a generate batch sees the old
    weights and version or the new ones, never a mix. A version below the engine's is
    refused with a 409 naming ``X-Policy-Version`` (expected >= the current one), and
    weights and version stay as they were; the same version again is accepted (a retried
    commit whose reply was lost).
``X-Weight-Commit: true | false`` (default true)
    false: the upload is validated (steps 1-3) and its tensors are staged in the app's
    memory, not loaded; the reply's ``num_loaded`` is 0. true: the staged tensors and
    this upload's (which win on a repeated name) go to ONE ``load_weights(...,
    policy_version=v)``: all or nothing. Values are checked there, so a non-finite one in
    any staged upload refuses the whole commit, naming the tensor. Staging ends as soon
    as a commit's body has been read whole, loaded or refused; a commit whose body never
    arrived (timeout, reset) keeps it, so the client's retry of that commit completes
    the push.

Rules, checked under the weight lock before the data section is read:

- a commit while tensors are staged must name a version: otherwise a 400 naming
  ``X-Policy-Version``, and the staging waits;
- staging belongs to one version, set by the first staged upload naming one (staged
  uploads may name it; an unnamed staging is adopted by whichever version names it).
  An upload naming another version drops it: that push was abandoned (one pusher at a
  time is assumed). A 409 drops the staging of the refused version (a refused commit:
  an unnamed staging too), which can never commit;
- staged tensors take at most one copy of the model's parameters: names are staged
  once (a repeat replaces the earlier tensor, and tensors that shared a buffer with the
  replaced one are copied out so the buffer can go).

Without either header an upload loads at once and leaves the version unchanged, as
before versions existed. Either header on an engine that keeps no policy version is a
501. A malformed value is a 400 naming the header. The reply is ``{"num_loaded": int,
"num_staged": int, "policy_version": int | null}``: tensors loaded by this upload (0
when staged), tensors waiting for a commit after it, and the engine's version after it
(null only for an engine that keeps none).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
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

__all__ = [
    "ACCEPTED_DTYPES",
    "COMMIT_HEADER",
    "POLICY_VERSION_HEADER",
    "StagedWeights",
    "TensorEntry",
    "UploadIntent",
    "UploadOutcome",
    "engine_policy_version",
    "parse_header",
    "parse_upload_headers",
    "receive_weights",
    "upload_caps",
]

logger = logging.getLogger(__name__)

POLICY_VERSION_HEADER = "X-Policy-Version"
COMMIT_HEADER = "X-Weight-Commit"
MAX_POLICY_VERSION = 2**63 - 1
"""Versions fit an int64 (metrics, tensors); a longer header value is refused before int()."""

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


@dataclass(frozen=True)
class UploadIntent:
    """What an upload's ``X-Policy-Version`` / ``X-Weight-Commit`` headers ask for."""

    policy_version: int | None = None
    """None when the header is absent."""
    commit: bool = True

    @property
    def versioned(self) -> bool:
        """Whether the upload uses versions or staging at all (needs a versioned engine)."""
        return self.policy_version is not None or not self.commit


@dataclass(frozen=True)
class UploadOutcome:
    """The reply of one upload (see the module docstring)."""

    num_loaded: int
    num_staged: int
    policy_version: int | None


class StagedWeights:
    """Tensors of ``X-Weight-Commit: false`` uploads waiting for their commit.

    Held in the app and touched only under its weight lock. Each tensor is a view into
    its upload's buffer (no copy), unless it outlived a tensor of the same buffer that a
    later upload replaced: then it is copied out, so staging never holds more than one
    copy of the model's parameters.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """The version staged uploads named; None when none named one."""

    def __len__(self) -> int:
        return len(self.tensors)

    def clear(self) -> None:
        self.tensors = {}
        self.version = None

    def add(self, named: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        replaced = {name for name, _ in named if name in self.tensors}
        if replaced:
            freed = {self.tensors[name].untyped_storage().data_ptr() for name in replaced}
            for name, tensor in self.tensors.items():
                if name not in replaced and tensor.untyped_storage().data_ptr() in freed:
                    self.tensors[name] = tensor.clone()
        self.tensors.update(named)
        if version is not None:
            self.version = version

    def take(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Staged tensors and ``named`` (which win on a repeated name); staging ends."""
        together = {**self.tensors, **dict(named)}
        self.clear()
        return list(together.items())


def engine_policy_version(engine: object) -> int | None:
    """The engine's ``policy_version``; None for an engine that keeps none (a wrapper
    written before versions existed), which then cannot take versioned uploads."""
    version = getattr(engine, "policy_version", None)
    return version if type(version) is int else None


def parse_upload_headers(request: web.Request) -> UploadIntent:
    """The upload's version headers, or a 400 naming the header that is malformed."""
    raw_version = _one_header(request, POLICY_VERSION_HEADER)
    version = None
    if raw_version is not None:
        text = raw_version.strip()
        # isascii: str.isdigit is also true of digits such as "²" that int() refuses.
        if not (text.isascii() and text.isdigit()):
            raise RequestValidationError(POLICY_VERSION_HEADER, "an int >= 0", raw_version)
        if len(text) > len(str(MAX_POLICY_VERSION)) or int(text) > MAX_POLICY_VERSION:
            raise RequestValidationError(
                POLICY_VERSION_HEADER, f"an int >= 0 and <= {MAX_POLICY_VERSION}", raw_version
            )
        version = int(text)
    raw_commit = _one_header(request, COMMIT_HEADER)
    commit = True
    if raw_commit is not None:
        word = raw_commit.strip().lower()
        if word not in ("true", "false"):
            raise RequestValidationError(COMMIT_HEADER, "true or false", raw_commit)
        commit = word == "true"
    return UploadIntent(policy_version=version, commit=commit)


def _one_header(request: web.Request, name: str) -> str | None:
    values = request.headers.getall(name, [])
    if len(values) > 1:
        raise RequestValidationError(name, "the header at most once", values)
    return values[0] if values else None


def _check_version(intent: UploadIntent, staged: StagedWeights, current: int) -> None:
    """The rules of the module docstring; may drop an abandoned staging."""
    version = intent.policy_version
    if version is None:
        if intent.commit and len(staged):
            raise RequestValidationError(
                POLICY_VERSION_HEADER,
                f"an int >= {current} (a commit of {len(staged)} staged tensors names "
                "their policy version)",
                None,
            )
        return
    if version < current:
        if staged.version == version or (intent.commit and staged.version is None):
            staged.clear()  # the refused push's own staging: it can never commit
        raise RequestValidationError(
            POLICY_VERSION_HEADER,
            f"an int >= {current} (the policy version serving now)",
            version,
            status=409,
        )
    if staged.version is not None and staged.version != version:
        logger.warning(
            "dropping %d staged tensors of policy version %d: an upload names version %d",
            len(staged),
            staged.version,
            version,
        )
        staged.clear()


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
            _check_version(intent, staged, current)
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
