"""Property: load_packed_body equals orjson.loads + decoding, or raises WireError.

Documents carry envelopes at random depths (choice level and nested), nulls,
random formatting (compact, indented, re-spaced separators, ASCII escapes) and
lookalikes: keys ending in a field name behind an escaped quote, envelope text
inside strings, field names as plain strings, unregistered keys holding envelopes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.errors import WireError
from inference.wire import PackedField, decode_packed_field, load_packed_body, pack_field

_ARRAYS = {
    PackedField.ROUTED_EXPERTS: [
        np.zeros((0, 2, 2), np.int64),
        np.arange(12).reshape(3, 2, 2),
        np.full((1, 1, 2), 300),
    ],
    PackedField.ROLLOUT_SAMPLE_SUPPORT: [np.array([[4, -1]]), np.zeros((0, 3), np.int64)],
    PackedField.ROLLOUT_SAMPLE_SUPPORT_LOGPROBS: [np.array([[-0.5, -np.inf]])],
    PackedField.PACKED_TOKEN_IDS: [np.arange(5)],
    PackedField.PACKED_LOGPROBS: [np.array([-1.25, -3.0])],
}
_ENVELOPES = [(f, pack_field(f, a)) for f, arrays in _ARRAYS.items() for a in arrays]
_REGISTERED = {f.key for f in PackedField}
_LOOKALIKE_KEYS = [
    'a"routed_experts',
    'x\\"packed_logprobs',
    "routed_experts\\",
    "data",
    '"data"',
    "routed_experts ",
    "unregistered",
    "rollout_sample_support_x",
]
_LOOKALIKE_TEXT = [
    orjson.dumps({"routed_experts": _ENVELOPES[1][1]}).decode(),
    '"routed_experts": {"data": "AAAA", "shape": [3], "dtype": "uint8"}',
    "routed_experts",
    '{"data":"',
    '\\"data\\"',
    "\\",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=8),
    st.sampled_from(_LOOKALIKE_TEXT),
)
keys = st.one_of(st.text(max_size=6), st.sampled_from(_LOOKALIKE_KEYS))


@st.composite
def registered_entry(draw: st.DrawFn) -> tuple[str, Any]:
    field, env = draw(st.sampled_from(_ENVELOPES))
    kind = draw(st.sampled_from(["env", "env", "env", "null", "reordered", "junk"]))
    if kind == "null":
        return field.key, None
    if kind == "reordered":  # data last: never spliced; an error at choice level
        return field.key, {"shape": env["shape"], "dtype": env["dtype"], "data": env["data"]}
    if kind == "junk":
        return field.key, draw(st.sampled_from([[1, 2], "AAAA", 0, {"x": 1}]))
    return field.key, dict(env)


def _with_fields(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    plain = st.dictionaries(keys, children, max_size=3)
    extra = st.lists(registered_entry(), max_size=2)
    # Lookalike and unregistered keys holding real envelopes: never spliced.
    decoys = st.lists(
        st.tuples(st.sampled_from(_LOOKALIKE_KEYS), st.sampled_from(_ENVELOPES)), max_size=2
    )
    return st.tuples(plain, extra, decoys).map(
        lambda t: {**t[0], **{k: dict(e) for k, (_, e) in t[2]}, **dict(t[1])}
    )


values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=3), _with_fields(children)),
    max_leaves=12,
)
documents = st.fixed_dictionaries(
    {"choices": st.lists(_with_fields(values), max_size=3)}, optional={"meta": values}
)


def _format(doc: Any, style: int) -> bytes:
    if style == 0:
        return orjson.dumps(doc)
    if style == 1:
        return json.dumps(doc).encode()
    if style == 2:
        return json.dumps(doc, indent=1, ensure_ascii=False).encode()
    return json.dumps(doc, separators=(" ,\n", " \t: ")).encode()


def _plain(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_plain(v) for v in doc]
    return bytes(doc).decode() if isinstance(doc, memoryview) else doc


def _decoded(doc: Any) -> list[Any]:
    """Every registered field anywhere, decoded (or the error class), in document order."""
    out: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _REGISTERED and value is not None:
                    try:
                        out.append(decode_packed_field(PackedField.from_key(key), value).tolist())
                    except (WireError, TypeError) as exc:
                        out.append(type(exc))
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=documents, style=st.integers(0, 3))
def test_equals_orjson_plus_decoding_or_raises(doc: dict[str, Any], style: int) -> None:
    raw = _format(doc, style)
    expected = orjson.loads(raw)
    try:
        ours = load_packed_body(raw)
    except WireError:
        # Allowed only where the document breaks the contract: a registered key at
        # choice level holding something other than an envelope or null.
        assert any(
            key in _REGISTERED
            and not (v is None or (isinstance(v, dict) and next(iter(v), None) == "data"))
            for c in expected["choices"]
            if isinstance(c, dict)
            for key, v in c.items()
        ), raw
        return
    assert _plain(ours) == expected
    assert _decoded(ours) == _decoded(expected)
    for choice in ours["choices"]:  # choice-level envelopes were spliced, zero-copy
        for key in _REGISTERED & choice.keys():
            assert choice[key] is None or isinstance(choice[key]["data"], memoryview)
