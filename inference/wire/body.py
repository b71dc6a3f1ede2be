"""``load_packed_body``: parse a generate response without materialising the base64.

Measured on a 2-core machine (97 MiB body, 90 MiB of route base64): ``orjson.loads``
of everything then decoding each ``str`` takes 218 ms; splicing the blobs out and
parsing the 7 MiB remainder takes 88 ms, at its floor. How:

1. One forward scan with ``bytes.find`` for ``"data``. At each hit, look *back*
   over optional JSON whitespace for ``{`` ``:`` and a registered key whose opening
   quote is not escaped, and forward for ``:`` ``"``. Only such a hit is an envelope
   of a registered field; the blob runs to the next ``"`` (base64 has no quotes or
   backslashes), found with memchr, and the scan resumes after it, so each blob byte
   is read once. A quote preceded by an even run of backslashes is structural in
   valid JSON, which is what rules out lookalikes: a key ending in a field name
   behind an escaped quote, or envelope text inside a string (its quotes are escaped).
2. The remainder, each blob replaced by a per-call random marker, goes to
   ``orjson.loads`` with the cyclic GC paused (GC passes while orjson builds
   millions of per-token objects cost up to 490 ms of 850 ms); the new objects are
   then moved to the oldest generation so the next young collection skips them.
3. Restore: each marker names its blob, so a blob lands exactly where it was cut
   from. ``choices[i].<key>`` (where clients read packed fields) must be absent,
   null or a spliced envelope; when those hold every blob, in order, restoring
   needs no walk. Otherwise a generic walk (30 ms on the lean body) finds the rest.
   Errors, all :class:`WireError`: an unterminated blob, a remainder orjson
   rejects, an unspliced value at ``choices[i].<key>`` (e.g. keys reordered), a
   blob that found no envelope (a duplicate key dropped it).
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterable
from typing import Any, Final

import orjson

from inference.errors import WireError
from inference.wire.fields import PackedField, as_fields

DEFAULT_FIELDS: Final[tuple[PackedField, ...]] = tuple(PackedField)

_WS: Final = frozenset(b" \t\n\r")
_QUOTE: Final = 0x22
_BACKSLASH: Final = 0x5C
# The scan looks for `"data` and checks the closing quote in _AFTER_DATA: a needle
# ending in `a` rather than in JSON's most frequent byte `"` lets bytes.find skip
# ahead more often (30 MiB of chat-style remainder: 19 ms vs 27 ms, measured).
_DATA: Final = b'"data'
# After `"data`: closing quote, optional whitespace, colon, optional whitespace,
# opening quote.
_AFTER_DATA: Final = re.compile(rb'"[ \t\n\r]*:[ \t\n\r]*"')


def _skip_ws_back(buf: bytes | bytearray, i: int) -> int:
    while i >= 0 and buf[i] in _WS:
        i -= 1
    return i


def _unescaped(buf: bytes | bytearray, quote: int) -> bool:
    """True when the quote at ``quote`` follows an even run of backslashes."""
    i = quote - 1
    while i >= 0 and buf[i] == _BACKSLASH:
        i -= 1
    return (quote - 1 - i) % 2 == 0


def _registered_key_before(
    buf: bytes | bytearray, data_quote: int, keys: tuple[bytes, ...]
) -> bytes | None:
    """The registered key whose envelope opens with the ``"data"`` at ``data_quote``."""
    i = _skip_ws_back(buf, data_quote - 1)
    if i < 0 or buf[i] != 0x7B:  # "{": data must be the envelope's first key
        return None
    i = _skip_ws_back(buf, i - 1)
    if i < 0 or buf[i] != 0x3A:  # ":"
        return None
    close = _skip_ws_back(buf, i - 1)
    if close < 0 or buf[close] != _QUOTE:
        return None
    for key in keys:
        open_ = close - len(key) - 1
        if (
            open_ >= 0
            and buf[open_] == _QUOTE
            and buf[open_ + 1 : close] == key
            and _unescaped(buf, open_)
        ):
            return key
    return None


def _as_bytes(raw: bytes | bytearray | memoryview) -> bytes | bytearray:
    if isinstance(raw, bytes | bytearray):
        return raw
    if isinstance(raw, memoryview):
        obj = raw.obj
        if raw.c_contiguous and isinstance(obj, bytes | bytearray) and raw.nbytes == len(obj):
            return obj  # a view of a whole buffer: scan the buffer itself, no copy
        return raw.tobytes()  # a partial or strided view: one copy
    raise TypeError(f"$: expected bytes, bytearray or memoryview, got {type(raw).__name__}")


class _Splice:
    """The blobs cut out of one body: key, byte span and the marker left behind."""

    def __init__(self) -> None:
        self.nonce = "~r3:" + os.urandom(8).hex() + ":"
        self.keys: list[str] = []
        self.spans: list[tuple[int, int]] = []
        self._index: dict[str, int] = {}

    def add(self, key: str, start: int, end: int) -> bytes:
        marker = f"{self.nonce}{len(self.spans)}"
        self._index[marker] = len(self.spans)
        self.keys.append(key)
        self.spans.append((start, end))
        return marker.encode()

    def index_of(self, data: Any) -> int | None:
        return self._index.get(data) if type(data) is str else None


def _scan(buf: bytes | bytearray, keys: tuple[bytes, ...]) -> tuple[_Splice, bytes | bytearray]:
    """Step 1: find registered blobs; return them and the remainder with markers."""
    splice = _Splice()
    # memoryview slices: the join below is then the remainder's only copy.
    view = memoryview(buf)
    pieces: list[bytes | memoryview] = []
    prev = pos = 0
    find = buf.find
    while True:
        hit = find(_DATA, pos)
        if hit < 0:
            break
        after = _AFTER_DATA.match(buf, hit + len(_DATA))
        if after is None:
            pos = hit + len(_DATA)
            continue
        start = after.end()
        key = _registered_key_before(buf, hit, keys)
        if key is None:  # an unregistered envelope or a lookalike: left to orjson
            pos = start
            continue
        end = find(b'"', start)
        name = key.decode()
        if end < 0:
            raise WireError(f"$..{name}.data", "a closing quote", f"unterminated from byte {start}")
        pieces.append(view[prev:start])
        pieces.append(splice.add(name, start, end))
        prev = pos = end
    if not splice.spans:
        return splice, buf
    pieces.append(view[prev:])
    return splice, b"".join(pieces)


def _loads(remainder: bytes | bytearray) -> Any:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        doc = orjson.loads(remainder)
        if was_enabled and gc.get_freeze_count() == 0:
            # The millions of (acyclic) objects orjson just built sit in the young
            # generation; the first collection after re-enabling would traverse them
            # all (130-250 ms on the rich body, measured). freeze+unfreeze moves them
            # straight to the oldest generation without a traversal. Skipped when the
            # caller froze objects itself (unfreeze would release theirs).
            gc.freeze()
            gc.unfreeze()
        return doc
    except orjson.JSONDecodeError as exc:
        raise WireError("$", "a JSON document", str(exc)) from None
    finally:
        if was_enabled:
            gc.enable()


def _check_choices(doc: Any, splice: _Splice, keys: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """Check ``choices[i].<key>`` (where clients read packed fields): each is absent,
    null or a spliced envelope, else a WireError naming the path. Returns those
    envelopes when they hold every blob in document order (the usual layout, no walk
    needed), else None."""
    if type(doc) is not dict or type(doc.get("choices")) is not list:
        return None
    found: list[dict[str, Any]] = []
    in_order = True
    for i, choice in enumerate(doc["choices"]):
        if type(choice) is not dict:
            in_order = False
            continue
        for key in keys:
            value = choice.get(key)
            if value is None:
                continue
            index = splice.index_of(value.get("data")) if type(value) is dict else None
            if index is None:
                raise WireError(
                    f"$.choices[{i}].{key}",
                    'a packed envelope whose first key is "data", or null',
                    list(value)[:4] if type(value) is dict else value,
                )
            in_order = in_order and index == len(found)
            found.append(value)
    return found if in_order and len(found) == len(splice.spans) else None


def _restore_walk(doc: Any, splice: _Splice, keys: frozenset[str]) -> list[dict[str, Any]]:
    """Generic walk (30 ms on the lean body): find every marker wherever it sits.

    A registered key outside ``choices[i]`` that holds something other than a
    spliced envelope (an escaped key spelling, a reordered envelope) is returned
    exactly as orjson parsed it: nothing was cut from it, so nothing is mis-parsed.
    """
    found: list[dict[str, Any] | None] = [None] * len(splice.spans)
    stack: list[Any] = [doc]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            for key, value in node.items():
                if key in keys and type(value) is dict:
                    index = splice.index_of(value.get("data"))
                    if index is not None:
                        found[index] = value
                        # No continue: a sidecar value may hold another envelope.
                if type(value) is dict or type(value) is list:
                    stack.append(value)
        else:
            stack.extend(v for v in node if type(v) is dict or type(v) is list)
    for index, value in enumerate(found):
        if value is None:
            raise WireError(
                f"$..{splice.keys[index]}",
                "an envelope in the parsed document for every blob (a duplicate key?)",
                f"an orphan blob at bytes {splice.spans[index]}",
            )
    return [v for v in found if v is not None]


def load_packed_body(
    raw: bytes | bytearray | memoryview, *, fields: Iterable[PackedField | str] = DEFAULT_FIELDS
) -> Any:
    """Parse a JSON body whose registered envelopes keep ``data`` as a memoryview into ``raw``.

    The result equals ``orjson.loads(raw)`` except that each registered field's
    envelope ``data`` is a zero-copy memoryview of its base64 bytes; decode with
    :func:`decode_packed_fields`. A memoryview ``raw`` over part of a buffer is
    copied once. Errors are :class:`WireError`; a non-bytes ``raw`` is a TypeError.
    """
    buf = _as_bytes(raw)
    keys = tuple(dict.fromkeys(field.key for field in as_fields(fields)))
    # Longest first, so "rollout_sample_support_logprobs" is tried before its prefix.
    key_bytes = tuple(sorted((k.encode() for k in keys), key=len, reverse=True))
    splice, remainder = _scan(buf, key_bytes)
    doc = _loads(remainder)
    del remainder
    found = _check_choices(doc, splice, keys)
    if found is None:
        found = _restore_walk(doc, splice, frozenset(keys))
    view = memoryview(buf)
    for envelope, (start, end) in zip(found, splice.spans, strict=True):
        envelope["data"] = view[start:end]
    return doc
