"""load_packed_body: zero-copy splicing, layouts, lookalikes and loud failures."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest

from inference.errors import WireError
from inference.wire import (
    PackedField,
    decode_packed_fields,
    dumps_generate_response,
    load_packed_body,
    pack_routed_experts,
    pack_sample_support,
)


def _routes(seed: int, tokens: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 300, size=(tokens, 3, 2))


def _choice(seed: int) -> dict[str, Any]:
    ids, lps = pack_sample_support(np.array([[1, 2, -1]] * 4), np.full((4, 3), -0.5))
    return {
        "token_ids": [1, 2, 3],
        "finish_reason": "stop",
        "logprobs": {"content": [{"logprob": -0.1}]},
        "routed_experts": pack_routed_experts(_routes(seed), extra={"start": seed}),
        "rollout_sample_support": ids,
        "rollout_sample_support_logprobs": lps,
    }


def _plain(doc: Any) -> Any:
    """Memoryview data back to str, for comparison with orjson.loads."""
    if isinstance(doc, dict):
        return {k: _plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_plain(v) for v in doc]
    if isinstance(doc, memoryview):
        return bytes(doc).decode()
    return doc


def _assert_spliced(doc: dict, raw: bytes, *paths: tuple[int, str]) -> None:
    for i, key in paths:
        data = doc["choices"][i][key]["data"]
        assert isinstance(data, memoryview) and data.obj is raw  # zero-copy into raw


def test_one_field_round_trip_zero_copy() -> None:
    raw = dumps_generate_response([{"token_ids": [1], "routed_experts": _routes(0)}])
    doc = load_packed_body(raw)
    _assert_spliced(doc, raw, (0, "routed_experts"))
    assert _plain(doc) == orjson.loads(raw)
    np.testing.assert_array_equal(
        decode_packed_fields(doc["choices"][0])["routed_experts"], _routes(0)
    )


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_raw_types(kind: type) -> None:
    raw = kind(orjson.dumps({"choices": [_choice(1)]}))
    doc = load_packed_body(raw)
    assert _plain(doc) == orjson.loads(bytes(raw))
    with pytest.raises(TypeError, match="bytes, bytearray or memoryview"):
        load_packed_body("{}")  # type: ignore[arg-type]


def test_multiple_fields_and_choices_sidecars_and_nulls() -> None:
    choices = [_choice(i) for i in range(3)]
    choices[1]["routed_experts"] = None
    del choices[2]["rollout_sample_support"], choices[2]["rollout_sample_support_logprobs"]
    raw = orjson.dumps({"choices": choices, "usage": {"tokens": 9}})
    doc = load_packed_body(raw)
    assert _plain(doc) == orjson.loads(raw)
    assert doc["choices"][1]["routed_experts"] is None
    assert doc["choices"][0]["routed_experts"]["start"] == 0  # sidecar preserved
    _assert_spliced(
        doc, raw, (0, "routed_experts"), (0, "rollout_sample_support"), (2, "routed_experts")
    )
    out = [decode_packed_fields(c, path=f"$.choices[{i}]") for i, c in enumerate(doc["choices"])]
    assert sorted(out[1]) == ["rollout_sample_support", "rollout_sample_support_logprobs"]
    assert sorted(out[2]) == ["routed_experts"]
    np.testing.assert_array_equal(out[2]["routed_experts"], _routes(2))


def test_fields_argument_limits_splicing() -> None:
    raw = orjson.dumps({"choices": [_choice(0)]})
    doc = load_packed_body(raw, fields=(PackedField.ROUTED_EXPERTS,))
    assert isinstance(doc["choices"][0]["routed_experts"]["data"], memoryview)
    assert isinstance(doc["choices"][0]["rollout_sample_support"]["data"], str)


@pytest.mark.parametrize(
    "dump",
    [
        lambda d: json.dumps(d).encode(),  # '"key": {"data": "'
        lambda d: json.dumps(d, indent=2).encode(),
        lambda d: json.dumps(d, separators=(" , ", " : ")).encode(),  # re-spacing proxy
        lambda d: json.dumps(d, indent="\t").replace("\n", "\r\n").encode(),
    ],
)
def test_respaced_json_still_splices(dump: Any) -> None:
    doc0 = orjson.loads(orjson.dumps({"choices": [_choice(0), _choice(1)]}))
    raw = dump(doc0)
    doc = load_packed_body(raw)
    assert _plain(doc) == doc0
    _assert_spliced(doc, raw, (0, "routed_experts"), (1, "rollout_sample_support_logprobs"))


def test_nested_and_top_level_envelopes_use_the_generic_walk() -> None:
    env = pack_routed_experts(_routes(3))
    body = {
        "routed_experts": env,
        "choices": [{"meta": {"deep": [{"routed_experts": pack_routed_experts(_routes(4))}]}}],
    }
    raw = orjson.dumps(body)
    doc = load_packed_body(raw)
    assert _plain(doc) == body
    assert isinstance(doc["routed_experts"]["data"], memoryview)
    assert isinstance(doc["choices"][0]["meta"]["deep"][0]["routed_experts"]["data"], memoryview)


def test_lookalikes_are_not_spliced() -> None:
    env = pack_routed_experts(_routes(5))
    envelope_text = orjson.dumps({"routed_experts": env}).decode()
    body = {
        "choices": [
            {
                'x\\"routed_experts': env,  # key ending in a field name behind an escaped quote
                'y"routed_experts': env,
                "text": envelope_text,  # envelope text inside a string
                "unregistered": env,  # unregistered field holding an envelope
                "list": ["routed_experts", '"data"', "routed_experts"],
                "routed_experts": env,
            }
        ]
    }
    raw = orjson.dumps(body)
    doc = load_packed_body(raw)
    choice = doc["choices"][0]
    assert _plain(doc) == body
    assert isinstance(choice["routed_experts"]["data"], memoryview)
    for key in ('x\\"routed_experts', 'y"routed_experts', "unregistered"):
        assert choice[key]["data"] == env["data"]  # left to orjson, a str
    assert choice["text"] == envelope_text


def test_unterminated_data_is_an_error() -> None:
    raw = b'{"choices":[{"routed_experts":{"data":"AAAA'
    with pytest.raises(WireError, match=r"\$\.\.routed_experts\.data: expected a closing quote"):
        load_packed_body(raw)


def test_reordered_envelope_is_an_error() -> None:
    env = pack_routed_experts(_routes(6))
    reordered = {"shape": env["shape"], "dtype": env["dtype"], "data": env["data"]}
    raw = orjson.dumps({"choices": [_choice(0), {"routed_experts": reordered}]})
    with pytest.raises(WireError) as info:
        load_packed_body(raw)
    assert info.value.path == "$.choices[1].routed_experts"
    assert 'first key is "data"' in str(info.value)
    # an empty reordered envelope too: its "" data is not mistaken for a spliced one
    empty = {"shape": [0, 3, 2], "dtype": "uint8", "data": ""}
    with pytest.raises(WireError, match=r"\$\.choices\[0\]\.routed_experts: expected a packed"):
        load_packed_body(orjson.dumps({"choices": [{"routed_experts": empty}]}))


@pytest.mark.parametrize("value", [[1, 2], "AAAA", 3, {"shape": [1]}])
def test_non_envelope_in_a_registered_field_is_an_error(value: Any) -> None:
    raw = orjson.dumps({"choices": [{"routed_experts": value}]})
    with pytest.raises(WireError, match=r"\$\.choices\[0\]\.routed_experts: expected"):
        load_packed_body(raw)


def test_blob_without_envelope_is_an_error() -> None:
    # A duplicate key: orjson keeps the last value, so the first blob has no envelope.
    env = orjson.dumps(pack_routed_experts(_routes(7))).decode()
    raw = f'{{"choices":[{{"routed_experts":{env},"routed_experts":null}}]}}'.encode()
    with pytest.raises(WireError, match=r"\$\.\.routed_experts: expected an envelope .* orphan"):
        load_packed_body(raw)


def test_invalid_json_is_an_error() -> None:
    env = orjson.dumps(pack_routed_experts(_routes(8))).decode()
    with pytest.raises(WireError, match=r"^\$: expected a JSON document"):
        load_packed_body(f'{{"choices":[{{"routed_experts":{env}}}]'.encode())
    # a backslash before the closing quote: the blob is cut short and the rest breaks
    with pytest.raises(WireError):
        load_packed_body(
            b'{"choices":[{"routed_experts":{"data":"AA\\"AA","shape":[3],"dtype":"uint8"}}]}'
        )


def test_bad_base64_surfaces_on_decode() -> None:
    raw = b'{"choices":[{"routed_experts":{"data":"AA=A","shape":[1,1,1],"dtype":"uint8"}}]}'
    doc = load_packed_body(raw)
    with pytest.raises(WireError, match=r"\$\.choices\[0\]\.routed_experts\.data: expected strict"):
        decode_packed_fields(doc["choices"][0])


def test_body_without_envelopes_equals_orjson() -> None:
    body = {
        "choices": [{"token_ids": [1, 2], "logprobs": None, "routed_experts": None}],
        "a": "data",
    }
    raw = orjson.dumps(body)
    assert load_packed_body(raw) == body
    assert load_packed_body(b"[]") == []


def test_gc_state_is_restored() -> None:
    import gc

    raw = orjson.dumps({"choices": [_choice(0)]})
    assert gc.isenabled()
    load_packed_body(raw)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        load_packed_body(raw)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(WireError):
        load_packed_body(b'{"choices": [')
    assert gc.isenabled()


def test_usual_layout_restores_without_the_generic_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    # The generic walk costs 30-180 ms on a real rollout body; envelopes at
    # choices[i].<key>, in document order, must be restored without it.
    import inference.wire.body as body_module

    calls: list[int] = []
    walk = body_module._restore_walk

    def counting_walk(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return walk(*args, **kwargs)

    monkeypatch.setattr(body_module, "_restore_walk", counting_walk)
    choices = [_choice(i) for i in range(3)]
    choices[1]["routed_experts"] = None
    raw = json.dumps(orjson.loads(orjson.dumps({"choices": choices})), indent=1).encode()
    doc = load_packed_body(raw)
    assert calls == []
    _assert_spliced(doc, raw, (0, "routed_experts"), (2, "rollout_sample_support_logprobs"))
    nested = {"choices": [{"meta": {"routed_experts": pack_routed_experts(_routes(8))}}]}
    doc = load_packed_body(orjson.dumps(nested))
    assert calls == [1]
    assert isinstance(doc["choices"][0]["meta"]["routed_experts"]["data"], memoryview)


def test_keys_that_merely_start_with_data_are_not_spliced() -> None:
    # The scan looks for `"data` and then requires the closing quote: "database" or
    # "data_v2" as an envelope's first key is no envelope.
    env = pack_routed_experts(_routes(9))
    lookalike = {"database": env["data"], "shape": env["shape"], "dtype": env["dtype"]}
    top = {"routed_experts": lookalike, "choices": [{"routed_experts": None}]}
    assert load_packed_body(orjson.dumps(top)) == top
    raw = orjson.dumps({"choices": [{"routed_experts": {"data_v2": env["data"]}}]})
    with pytest.raises(WireError, match=r"\$\.choices\[0\]\.routed_experts: expected a packed"):
        load_packed_body(raw)


def test_envelope_nested_in_another_envelopes_sidecar_is_restored() -> None:
    inner_routes, outer_routes = _routes(7), _routes(8)
    outer = pack_routed_experts(outer_routes)
    outer["meta"] = {"routed_experts": pack_routed_experts(inner_routes)}
    raw = orjson.dumps({"choices": [{"routed_experts": outer}]})
    doc = load_packed_body(raw)
    env = doc["choices"][0]["routed_experts"]
    inner = env["meta"]["routed_experts"]
    assert isinstance(env["data"], memoryview) and isinstance(inner["data"], memoryview)
    np.testing.assert_array_equal(
        decode_packed_fields(doc["choices"][0])["routed_experts"], outer_routes
    )
    np.testing.assert_array_equal(decode_packed_fields(env["meta"])["routed_experts"], inner_routes)


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_partial_memoryview_is_parsed_from_its_own_bytes(kind: type) -> None:
    # A view of a slice of a larger buffer (a socket read buffer, a framed stream)
    # must be parsed from the bytes it shows, not from the buffer it lives in.
    body = orjson.dumps({"choices": [_choice(3)]})
    raw = memoryview(kind(b"garbage" + body + b"tail"))[7:-4]
    assert bytes(raw) == body
    doc = load_packed_body(raw)
    assert _plain(doc) == orjson.loads(body)
    out = decode_packed_fields(doc["choices"][0], path="$.choices[0]")
    np.testing.assert_array_equal(out["routed_experts"], _routes(3))
    # Also a view of a prefix, and one of a suffix, of a larger buffer.
    for raw in (memoryview(kind(body + b"tail"))[:-4], memoryview(kind(b"garbage" + body))[7:]):
        assert _plain(load_packed_body(raw)) == orjson.loads(body)
