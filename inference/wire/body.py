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

Fields in the ``.npy`` string form (:class:`~inference.wire.npy.NpyField`, vLLM's
``"routed_experts": "<base64 .npy>"``) ride the same scan with one more needle,
``"<key>"``: a hit counts when its opening quote is structural, it follows ``{`` or
``,`` (it is a key) and ``:`` then ``"`` come next (its value is a string). The string
is cut like an envelope's data, and the restored value is the memoryview itself. Each
needle's ``bytes.find`` reads the body once, so a body scanned for one form only
(either client) costs what it did before.
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
from inference.wire.npy import NpyField

DEFAULT_FIELDS: Final[tuple[PackedField, ...]] = tuple(PackedField)
"""Every envelope field of the registry (our server's replies)."""

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
# After an .npy-form needle `"<key>"`: optional whitespace, colon, optional
# whitespace, the opening quote of a string value.
_AFTER_KEY: Final = re.compile(rb'[ \t\n\r]*:[ \t\n\r]*"')
_ENVELOPE: Final = "envelope"
_NPY: Final = "npy"


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
    """The blobs cut out of one body: key, form, byte span and the marker left behind."""

    def __init__(self) -> None:
        self.nonce = "~r3:" + os.urandom(8).hex() + ":"
        self.keys: list[str] = []
        self.forms: list[str] = []
        self.spans: list[tuple[int, int]] = []
        self._index: dict[str, int] = {}

    def add(self, key: str, form: str, start: int, end: int) -> bytes:
        marker = f"{self.nonce}{len(self.spans)}"
        self._index[marker] = len(self.spans)
        self.keys.append(key)
        self.forms.append(form)
        self.spans.append((start, end))
        return marker.encode()

    def index_of(self, data: Any, form: str) -> int | None:
        index = self._index.get(data) if type(data) is str else None
        return index if index is not None and self.forms[index] == form else None


def _npy_value_start(buf: bytes | bytearray, hit: int, needle_len: int) -> int | None:
    """Where the string value of the ``"<key>"`` at ``hit`` starts, if it is an
    .npy-form hit: a structural quote, in key position, with a string value."""
    if not _unescaped(buf, hit):
        return None
    before = _skip_ws_back(buf, hit - 1)
    if before < 0 or buf[before] not in b"{,":
        return None
    after = _AFTER_KEY.match(buf, hit + needle_len)
    return None if after is None else after.end()


def _scan(
    buf: bytes | bytearray, keys: tuple[bytes, ...], npy_keys: tuple[bytes, ...]
) -> tuple[_Splice, bytes | bytearray]:
    """Step 1: find registered blobs; return them and the remainder with markers.

    One needle per form: `"data` for envelopes (the key is checked backwards from it),
    `"<key>"` per .npy-form key. Hits are taken in document order; each needle's next
    hit is cached and looked up again only once the scan has passed it, so every
    byte is read once per needle.
    """
    splice = _Splice()
    # memoryview slices: the join below is then the remainder's only copy.
    view = memoryview(buf)
    pieces: list[bytes | memoryview] = []
    find = buf.find
    needles = ([_DATA] if keys else []) + [b'"' + k + b'"' for k in npy_keys]
    nexts = [find(n, 0) for n in needles]
    prev = 0
    while True:
        best = -1
        for j, hit in enumerate(nexts):
            if hit >= 0 and (best < 0 or hit < nexts[best]):
                best = j
        if best < 0:
            break
        hit, needle = nexts[best], needles[best]
        name, form, start = "", _ENVELOPE, -1
        if needle is _DATA:
            after = _AFTER_DATA.match(buf, hit + len(_DATA))
            key = None if after is None else _registered_key_before(buf, hit, keys)
            if after is not None and key is not None:
                name, start = key.decode(), after.end()
            # else: an unregistered envelope or a lookalike, left to orjson
        else:
            value = _npy_value_start(buf, hit, len(needle))
            if value is not None:
                name, form, start = needle[1:-1].decode(), _NPY, value
        if start < 0:
            nexts[best] = find(needle, hit + 1)
            continue
        # The blob runs to the next quote: base64 has no quotes or backslashes.
        end = find(b'"', start)
        if end < 0:
            where = f"$..{name}.data" if form == _ENVELOPE else f"$..{name}"
            raise WireError(where, "a closing quote", f"unterminated from byte {start}")
        pieces.append(view[prev:start])
        pieces.append(splice.add(name, form, start, end))
        prev = end
        # Every needle resumes after the blob, so each blob byte is read once per needle.
        for j, cached in enumerate(nexts):
            if 0 <= cached < end:
                nexts[j] = find(needles[j], end)
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


Slot = tuple[dict[str, Any], str]
"""Where a blob's memoryview goes back: (object, key) — an envelope and "data", or a
choice and an .npy-form field's key."""


def _slot_of(
    holder: dict[str, Any], key: str, value: Any, splice: _Splice, forms: dict[str, set[str]]
) -> tuple[int, Slot] | None:
    """The blob spliced out of ``holder[key]`` (``value``) and its slot, if any."""
    key_forms = forms.get(key, set())
    if _ENVELOPE in key_forms and type(value) is dict:
        index = splice.index_of(value.get("data"), _ENVELOPE)
        if index is not None:
            return index, (value, "data")
    if _NPY in key_forms and type(value) is str:
        index = splice.index_of(value, _NPY)
        if index is not None:
            return index, (holder, key)
    return None


def _expected(key_forms: set[str]) -> str:
    names = []
    if _ENVELOPE in key_forms:
        names.append('a packed envelope whose first key is "data"')
    if _NPY in key_forms:
        names.append("a base64 .npy string")
    return ", ".join(names) + ", or null"


def _check_choices(doc: Any, splice: _Splice, forms: dict[str, set[str]]) -> list[Slot] | None:
    """Check ``choices[i].<key>`` (where clients read packed fields): each is absent,
    null or a spliced value of a registered form, else a WireError naming the path.
    Returns their slots when they hold every blob in document order (the usual
    layout, no walk needed), else None."""
    if type(doc) is not dict or type(doc.get("choices")) is not list:
        return None
    found: list[Slot] = []
    in_order = True
    for i, choice in enumerate(doc["choices"]):
        if type(choice) is not dict:
            in_order = False
            continue
        for key, key_forms in forms.items():
            value = choice.get(key)
            if value is None:
                continue
            spliced = _slot_of(choice, key, value, splice, forms)
            if spliced is None:
                raise WireError(
                    f"$.choices[{i}].{key}",
                    _expected(key_forms),
                    list(value)[:4] if type(value) is dict else value,
                )
            index, slot = spliced
            in_order = in_order and index == len(found)
            found.append(slot)
    return found if in_order and len(found) == len(splice.spans) else None


def _restore_walk(doc: Any, splice: _Splice, forms: dict[str, set[str]]) -> list[Slot]:
    """Generic walk (30 ms on the lean body): find every marker wherever it sits.

    A registered key outside ``choices[i]`` that holds something other than a
    spliced value (an escaped key spelling, a reordered envelope) is returned
    exactly as orjson parsed it: nothing was cut from it, so nothing is mis-parsed.
    """
    found: list[Slot | None] = [None] * len(splice.spans)
    stack: list[Any] = [doc]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            for key, value in node.items():
                if key in forms:
                    spliced = _slot_of(node, key, value, splice, forms)
                    if spliced is not None:
                        found[spliced[0]] = spliced[1]
                        # No continue: a sidecar value may hold another envelope.
                if type(value) is dict or type(value) is list:
                    stack.append(value)
        else:
            stack.extend(v for v in node if type(v) is dict or type(v) is list)
    for index, slot in enumerate(found):
        if slot is None:
            what = "an envelope" if splice.forms[index] == _ENVELOPE else "a field value"
            raise WireError(
                f"$..{splice.keys[index]}",
                f"{what} in the parsed document for every blob (a duplicate key?)",
                f"an orphan blob at bytes {splice.spans[index]}",
            )
    return [slot for slot in found if slot is not None]


def load_packed_body(
    raw: bytes | bytearray | memoryview,
    *,
    fields: Iterable[PackedField | NpyField | str] = DEFAULT_FIELDS,
) -> Any:
    """Parse a JSON body whose registered fields keep their base64 as memoryviews into ``raw``.

    The result equals ``orjson.loads(raw)`` except that each envelope field's ``data``
    (:class:`PackedField`, or its key as a str) and each .npy-form field's value
    (:class:`NpyField`) is a zero-copy memoryview of its base64 bytes; decode with
    :func:`decode_packed_fields` / :func:`decode_npy_field`. A memoryview ``raw`` over
    part of a buffer is copied once. Errors are :class:`WireError`; a non-bytes
    ``raw`` is a TypeError.
    """
    buf = _as_bytes(raw)
    fields = tuple(fields)
    npy = tuple(dict.fromkeys(f.key for f in fields if isinstance(f, NpyField)))
    envelope = tuple(
        dict.fromkeys(f.key for f in as_fields(f for f in fields if not isinstance(f, NpyField)))
    )
    forms: dict[str, set[str]] = {}
    for key in envelope:
        forms.setdefault(key, set()).add(_ENVELOPE)
    for key in npy:
        forms.setdefault(key, set()).add(_NPY)
    # Longest first, so "rollout_sample_support_logprobs" is tried before its prefix.
    key_bytes = tuple(sorted((k.encode() for k in envelope), key=len, reverse=True))
    splice, remainder = _scan(buf, key_bytes, tuple(k.encode() for k in npy))
    doc = _loads(remainder)
    del remainder
    found = _check_choices(doc, splice, forms)
    if found is None:
        found = _restore_walk(doc, splice, forms)
    view = memoryview(buf)
    for (holder, key), (start, end) in zip(found, splice.spans, strict=True):
        holder[key] = view[start:end]
    return doc
