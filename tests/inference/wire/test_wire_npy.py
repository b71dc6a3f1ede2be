"""The .npy string form (vLLM's ``routed_experts``): decoding, splicing, loud failures.

Payloads come from ``np.save`` (always) and from vLLM's own serializer and response
writer when its venv is installed (``tests/vllm_reference.py``).
"""

from __future__ import annotations

import io
import json
import struct
from typing import Any

import numpy as np
import orjson
import pybase64
import pytest

from inference.errors import WireError
from inference.wire import (
    NpyField,
    PackedField,
    decode_npy_field,
    decode_packed_fields,
    load_packed_body,
    pack_routed_experts,
)
from inference.wire.npy import MAX_HEADER_BYTES, encode_npy
from tests.vllm_reference import ROUTE_ARRAYS, SKIP_REASON, route_array, vllm_reference

ROUTES = NpyField.ROUTED_EXPERTS
# Canonical dtype after decoding: vLLM picks by expert count, the project by max id.
CANONICAL = {
    "uint8": "uint8",
    "uint16_small": "int16",  # max id 299
    "uint16_large": "int32",  # max id > 32767
    "int32": "uint8",  # max id 7
    "empty": "uint8",
}


def _plain(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_plain(v) for v in doc]
    if isinstance(doc, memoryview):
        return bytes(doc).decode()
    return doc


def _npy(
    header: str | None = None,
    data: bytes = b"",
    *,
    version: tuple[int, int] = (1, 0),
    header_len: int | None = None,
) -> str:
    """A hand-built .npy payload (base64): header text as given, padded like np.save."""
    text = (header or "").encode("latin1")
    fmt = "<H" if version == (1, 0) else "<I"
    length = len(text) if header_len is None else header_len
    raw = b"\x93NUMPY" + bytes(version) + struct.pack(fmt, length) + text + data
    return pybase64.b64encode(raw).decode()


def _header(descr: str = "|u1", fortran: Any = False, shape: Any = (2, 3, 2)) -> str:
    return f"{{'descr': {descr!r}, 'fortran_order': {fortran!r}, 'shape': {shape!r}, }}\n"


def _decode(payload: Any, **kwargs: Any) -> np.ndarray:
    return decode_npy_field(ROUTES, payload, path="$.x", **kwargs)


@pytest.mark.parametrize("name", sorted(ROUTE_ARRAYS))
@pytest.mark.parametrize("kind", [str, bytes, memoryview])
def test_np_save_payloads_round_trip_in_the_canonical_dtype(name: str, kind: type) -> None:
    arr = route_array(name)
    b64 = encode_npy(arr)
    data = b64 if kind is str else kind(b64.encode())
    out = _decode(data, shape=(arr.shape[0], arr.shape[1], arr.shape[2]))
    np.testing.assert_array_equal(out, arr)
    assert out.dtype == np.dtype(CANONICAL[name]) and out.shape == arr.shape
    assert out.flags.writeable and out.flags.c_contiguous
    out[...] = 0  # writable: the decoded buffer, never the caller's


def test_expected_shape_wildcards() -> None:
    b64 = encode_npy(route_array("uint8"))  # [5, 3, 2]
    assert _decode(b64, shape=(None, 3, 2)).shape == (5, 3, 2)
    assert _decode(b64, shape=(5, None, None)).shape == (5, 3, 2)
    assert _decode(b64).shape == (5, 3, 2)
    with pytest.raises(ValueError, match=r"shape: expected 3 dims"):
        _decode(b64, shape=(5, 3))


def _reference() -> dict[str, dict[str, str]]:
    ref = vllm_reference()
    if ref is None:
        pytest.skip(SKIP_REASON)
    return ref


@pytest.mark.parametrize("name", sorted(ROUTE_ARRAYS))
def test_vllm_serializer_payloads_decode(name: str) -> None:
    ref = _reference()
    arr = route_array(name)
    # vLLM writes .npy with np.save: the same bytes as ours, so np.save tests cover it.
    assert ref["npy"][name] == encode_npy(arr)
    out = _decode(ref["npy"][name], shape=arr.shape)
    np.testing.assert_array_equal(out, arr)
    assert out.dtype == np.dtype(CANONICAL[name])


def test_vllm_reply_body_splices_routes_zero_copy() -> None:
    ref = _reference()
    raw = ref["bodies"]["spanning"].encode()
    doc = load_packed_body(raw, fields=(ROUTES,))
    choice = doc["choices"][0]
    assert isinstance(choice["routed_experts"], memoryview)
    assert choice["routed_experts"].obj is raw  # a view into the body, no str built
    assert _plain(doc) == orjson.loads(raw)
    np.testing.assert_array_equal(_decode(choice["routed_experts"]), route_array("uint8"))
    plain = ref["bodies"]["plain"].encode()
    assert load_packed_body(plain, fields=(ROUTES,)) == orjson.loads(plain)


def _body(*routes: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "choices": [
            {"index": i, "token_ids": [1, 2], "routed_experts": r} for i, r in enumerate(routes)
        ],
        **extra,
    }


def test_np_save_body_splices_every_choice_and_passes_nulls() -> None:
    a, b = route_array("uint8"), route_array("int32")
    body = _body(encode_npy(a), None, encode_npy(b))
    raw = orjson.dumps(body)
    doc = load_packed_body(raw, fields=(ROUTES,))
    assert _plain(doc) == body
    assert doc["choices"][1]["routed_experts"] is None
    for i, arr in ((0, a), (2, b)):
        view = doc["choices"][i]["routed_experts"]
        assert isinstance(view, memoryview) and view.obj is raw
        np.testing.assert_array_equal(_decode(view), arr)


@pytest.mark.parametrize(
    "dump",
    [
        lambda d: json.dumps(d).encode(),  # '"routed_experts": "'
        lambda d: json.dumps(d, indent=2).encode(),
        lambda d: json.dumps(d, separators=(" , ", " : ")).encode(),  # a re-spacing proxy
        lambda d: json.dumps(d, indent="\t").replace("\n", "\r\n").encode(),
    ],
)
def test_respaced_json_still_splices(dump: Any) -> None:
    body = _body(encode_npy(route_array("uint8")), encode_npy(route_array("empty")))
    raw = dump(body)
    doc = load_packed_body(raw, fields=(ROUTES,))
    assert _plain(doc) == body
    assert all(isinstance(c["routed_experts"], memoryview) for c in doc["choices"])


def test_lookalikes_are_not_spliced() -> None:
    b64 = encode_npy(route_array("uint8"))
    text = orjson.dumps({"routed_experts": b64}).decode()
    body = {
        "choices": [
            {
                'x\\"routed_experts': b64,  # a key ending in the name behind an escaped quote
                'y"routed_experts': b64,
                "text": text,  # the whole key/value pair inside a string
                "list": ["routed_experts", "routed_experts", b64],  # the name as a value
                "also": {"routed_experts": ["routed_experts"]},  # the key with a non-string
                "routed_experts": b64,
            }
        ]
    }
    raw = orjson.dumps(body)
    doc = load_packed_body(raw, fields=(ROUTES,))
    assert _plain(doc) == body
    choice = doc["choices"][0]
    assert isinstance(choice["routed_experts"], memoryview)
    for key in ('x\\"routed_experts', 'y"routed_experts', "text"):
        assert type(choice[key]) is str


def test_nested_strings_are_restored_by_the_walk() -> None:
    a, b = route_array("uint8"), route_array("int32")
    body = {
        "routed_experts": encode_npy(a),
        "choices": [{"meta": {"routed_experts": encode_npy(b)}}],
    }
    raw = orjson.dumps(body)
    doc = load_packed_body(raw, fields=(ROUTES,))
    assert _plain(doc) == body
    np.testing.assert_array_equal(_decode(doc["routed_experts"]), a)
    np.testing.assert_array_equal(_decode(doc["choices"][0]["meta"]["routed_experts"]), b)


def test_both_forms_in_one_scan() -> None:
    # The same key registered in both forms: each choice may carry either.
    a, b = route_array("uint8"), route_array("int32")
    body = {
        "choices": [{"routed_experts": pack_routed_experts(a)}, {"routed_experts": encode_npy(b)}]
    }
    raw = orjson.dumps(body)
    doc = load_packed_body(raw, fields=(PackedField.ROUTED_EXPERTS, ROUTES))
    assert _plain(doc) == body
    envelope = doc["choices"][0]
    assert isinstance(envelope["routed_experts"]["data"], memoryview)
    np.testing.assert_array_equal(decode_packed_fields(envelope)["routed_experts"], a)
    np.testing.assert_array_equal(_decode(doc["choices"][1]["routed_experts"]), b)


def test_only_the_registered_form_is_accepted() -> None:
    string = orjson.dumps(_body(encode_npy(route_array("uint8"))))
    with pytest.raises(WireError, match=r"\$\.choices\[0\]\.routed_experts: expected a packed env"):
        load_packed_body(string)  # the envelope form only (our server's replies)
    envelope = orjson.dumps(_body(pack_routed_experts(route_array("uint8"))))
    with pytest.raises(
        WireError,
        match=r"\$\.choices\[0\]\.routed_experts: expected a base64 \.npy string, or null",
    ):
        load_packed_body(envelope, fields=(ROUTES,))
    for value in (17, ["AAAA"], True):
        with pytest.raises(WireError, match=r"\$\.choices\[0\]\.routed_experts: expected a base64"):
            load_packed_body(orjson.dumps(_body(value)), fields=(ROUTES,))


def test_unterminated_string_and_orphans_are_errors() -> None:
    with pytest.raises(WireError, match=r"^\$\.\.routed_experts: expected a closing quote"):
        load_packed_body(b'{"choices":[{"routed_experts":"k05VTVBZ', fields=(ROUTES,))
    b64 = encode_npy(route_array("uint8"))
    duplicate = f'{{"choices":[{{"routed_experts":"{b64}","routed_experts":null}}]}}'.encode()
    with pytest.raises(WireError, match=r"\$\.\.routed_experts: expected a field value .* orphan"):
        load_packed_body(duplicate, fields=(ROUTES,))
    with pytest.raises(WireError, match=r"^\$: expected a JSON document"):
        load_packed_body(f'{{"choices":[{{"routed_experts":"{b64}"}}]'.encode(), fields=(ROUTES,))


def test_escaped_characters_in_the_string_fail_on_decode() -> None:
    # A writer that escapes "/" as "\/" is valid JSON, but the blob is cut at the first
    # quote and the backslash is no base64: a loud error, never a silent mis-parse.
    b64 = encode_npy(route_array("uint8"))
    raw = json.dumps(_body(b64)).replace("/", "\\/").encode()
    if b"\\/" not in raw:
        raw = json.dumps(_body(b64[:8] + "\\/" + b64[8:])).encode()
    doc = load_packed_body(raw, fields=(ROUTES,))
    with pytest.raises(WireError, match=r"\$\.x: expected strict padded base64"):
        _decode(doc["choices"][0]["routed_experts"])


# ---- adversarial payloads: each a WireError naming the path ------------------------------

_GOOD = np.arange(12, dtype=np.uint8).reshape(2, 3, 2)


def _save(arr: np.ndarray, **kwargs: Any) -> str:
    out = io.BytesIO()
    np.save(out, arr, **kwargs)
    return pybase64.b64encode(out.getvalue()).decode()


_PICKLED: list[str] = []


def _record(note: str) -> str:
    _PICKLED.append(note)
    return note


class _Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _record, ("unpickled",)


def _cases() -> list[tuple[str, Any, str, str]]:
    good = encode_npy(_GOOD)
    raw = pybase64.b64decode(good)
    body = raw[raw.index(b"\n") + 1 :]  # the 12 data bytes
    header = _header()
    return [
        # id, payload, error path, expected text
        ("bad base64 alphabet", good[:20] + "!" + good[21:], "$.x", "strict padded base64"),
        ("truncated base64", good[:-3], "$.x", "strict padded base64"),
        ("not a string", 17, "$.x", "a base64 .npy string"),
        ("truncated data", pybase64.b64encode(raw[:-4]).decode(), "$.x.data", "12 bytes for shape"),
        ("truncated header", pybase64.b64encode(raw[:40]).decode(), "$.x.header", "truncated"),
        ("truncated prefix", pybase64.b64encode(raw[:9]).decode(), "$.x", "prefix of 10 bytes"),
        ("empty payload", "", "$.x", "magic"),
        ("bad magic", pybase64.b64encode(b"\x93NUMPX" + raw[6:]).decode(), "$.x", "magic"),
        ("bad version", _npy(header, body, version=(4, 0)), "$.x.version", "1.0, 2.0 or 3.0"),
        ("float32", _save(_GOOD.astype(np.float32)), "$.x.dtype", "one of"),
        ("int16", _save(_GOOD.astype(np.int16)), "$.x.dtype", "one of"),
        ("int64", _save(_GOOD.astype(np.int64)), "$.x.dtype", "one of"),
        ("big-endian uint16", _save(_GOOD.astype(">u2")), "$.x.dtype", "one of"),
        (
            "object (pickle)",
            _save(np.array([_Boom()], dtype=object), allow_pickle=True),
            "$.x.dtype",
            "'|O'",
        ),
        (
            "fortran order",
            _save(np.asfortranarray(np.arange(24, dtype=np.uint8).reshape(2, 3, 4))),
            "$.x.fortran_order",
            "C order",
        ),
        ("rank 2", _save(_GOOD.reshape(6, 2)), "$.x.shape", "3 dims"),
        ("rank 4", _save(_GOOD.reshape(2, 3, 2, 1)), "$.x.shape", "3 dims"),
        ("wrong layers", _save(_GOOD.reshape(2, 2, 3)), "$.x.shape[1]", "3 (expected shape"),
        ("wrong top_k", _save(np.zeros((2, 3, 4), np.uint8)), "$.x.shape[2]", "2 (expected shape"),
        (
            "header claims more rows",
            _npy(_header(shape=(3, 3, 2)), body),
            "$.x.data",
            "18 bytes for shape [3, 3, 2]",
        ),
        (
            "header claims fewer rows",
            _npy(_header(shape=(1, 3, 2)), body),
            "$.x.data",
            "6 bytes for shape [1, 3, 2]",
        ),
        ("header claims empty", _npy(_header(shape=(0, 3, 2)), body), "$.x.data", "0 bytes"),
        ("bool dim", _npy(_header(shape=(True, 3, 2)), body), "$.x.shape[0]", "non-negative int"),
        ("negative dim", _npy(_header(shape=(-2, 3, 2)), body), "$.x.shape[0]", "non-negative int"),
        ("float dim", _npy(_header(shape=(2.0, 3, 2)), body), "$.x.shape[0]", "non-negative int"),
        ("list shape", _npy(_header(shape=[2, 3, 2]), body), "$.x.shape", "tuple"),
        ("fortran not bool", _npy(_header(fortran=0), body), "$.x.fortran_order", "False"),
        ("descr not str", _npy(_header(descr=5), body), "$.x.dtype", "one of"),  # type: ignore[arg-type]
        ("header is code", _npy("__import__('os').getcwd()\n", body), "$.x.header", "dict literal"),
        ("header not a dict", _npy("[1, 2, 3]\n", body), "$.x.header", "a dict with keys"),
        (
            "header extra key",
            _npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3, 2), 'x': 1}", body),
            "$.x.header",
            "a dict with keys",
        ),
        (
            "header missing key",
            _npy("{'descr': '|u1', 'shape': (2, 3, 2)}", body),
            "$.x.header",
            "a dict with keys",
        ),
        (
            "header length lies",
            _npy(header, body, header_len=len(header) + 500),
            "$.x.header",
            "truncated",
        ),
        (
            "header too long",
            _npy(header, body, version=(2, 0), header_len=MAX_HEADER_BYTES + 1),
            "$.x.header",
            f"at most {MAX_HEADER_BYTES}",
        ),
        (
            "negative int32 id",
            _save(np.array([[[0, -1]]], dtype=np.int32)),
            "$.x",
            "non-negative expert ids",
        ),
    ]


@pytest.mark.parametrize(
    ("payload", "path", "text"), [c[1:] for c in _cases()], ids=[c[0] for c in _cases()]
)
def test_malformed_payloads_name_the_path(payload: Any, path: str, text: str) -> None:
    shape = (None, 3, 2) if path not in ("$.x",) else None
    with pytest.raises(WireError) as info:
        _decode(payload, shape=shape)
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: expected ")
    assert text in str(info.value)
    assert _PICKLED == []  # an object array is refused before anything is unpickled


def test_rows_checked_when_known() -> None:
    with pytest.raises(WireError) as info:
        _decode(encode_npy(_GOOD), shape=(3, 3, 2))
    assert info.value.path == "$.x.shape[0]"
    assert "expected 3 (expected shape [3, 3, 2]), got 2" in str(info.value)


def test_empty_rows_and_v2_v3_headers() -> None:
    empty = np.zeros((0, 3, 2), np.uint8)
    assert _decode(encode_npy(empty), shape=(0, 3, 2)).shape == (0, 3, 2)
    for version in ((2, 0), (3, 0)):
        out = _decode(_npy(_header(), _GOOD.tobytes(), version=version), shape=(2, 3, 2))
        np.testing.assert_array_equal(out, _GOOD)


def test_wire_errors_are_value_errors_never_type_errors() -> None:
    for _, payload, _, _ in _cases():
        try:
            _decode(payload, shape=(None, 3, 2))
        except Exception as exc:  # noqa: BLE001 - the class is what is checked
            assert isinstance(exc, WireError) and isinstance(exc, ValueError), type(exc)
