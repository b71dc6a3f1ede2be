"""load_packed_body, deterministic cases: packed fields in any order in a choice and
in the ``fields`` argument, and empty ``data`` strings.

Each blob must land in the envelope it was cut from, whatever order the document or the
registry puts the fields in; arrays are compared exactly, and one case gives two fields
the same byte size, so a swap cannot surface as a size error. These bugs were once
caught only when the property test (test_wire_body_property.py) happened to generate
the layout; scripts/mutate.py plants them against this file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from inference.wire import PackedField, decode_packed_fields, load_packed_body
from inference.wire.fields import pack_field

ROUTES = PackedField.ROUTED_EXPERTS.key
SUPPORT = PackedField.ROLLOUT_SAMPLE_SUPPORT.key
SUPPORT_LOGPROBS = PackedField.ROLLOUT_SAMPLE_SUPPORT_LOGPROBS.key
TOKEN_IDS = PackedField.PACKED_TOKEN_IDS.key
REGISTRY = tuple(PackedField)
REVERSED = tuple(reversed(PackedField))


def _arrays(seed: int, *, same_size: bool) -> dict[str, np.ndarray]:
    """Routes and a support pair for one choice. ``same_size``: routes in int32 (an id
    over 32767) with as many elements as the support, so both blobs are 48 bytes, and
    support ids over 32767 too, so each blob also passes the other field's checks: a
    swap then decodes without any error, to the wrong values."""
    rng = np.random.default_rng(seed)
    if same_size:
        routes = rng.integers(0, 70_000, size=(2, 3, 2)).astype(np.int32)
        routes[0, 0, 0] = 40_000  # int32 is then the canonical dtype
        support = rng.integers(33_000, 70_000, size=(4, 3)).astype(np.int32)
    else:
        routes = rng.integers(0, 200, size=(5, 3, 2)).astype(np.uint8)
        support = rng.integers(0, 260, size=(4, 3)).astype(np.int32)
    logprobs = -rng.random((4, 3)).astype(np.float32)
    return {ROUTES: routes, SUPPORT: support, SUPPORT_LOGPROBS: logprobs}


def _choice(arrays: dict[str, np.ndarray], order: tuple[str, ...]) -> dict[str, Any]:
    """A choice whose packed fields appear in ``order`` (dicts keep insertion order)."""
    choice: dict[str, Any] = {"token_ids": [1, 2], "finish_reason": "stop"}
    for key in order:
        choice[key] = pack_field(PackedField.from_key(key), arrays[key])
    return choice


def _assert_decodes_to(choice: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    decoded = decode_packed_fields(choice)
    assert set(decoded) == set(arrays)
    for key, expected in arrays.items():
        assert decoded[key].dtype == expected.dtype, key
        np.testing.assert_array_equal(decoded[key], expected, err_msg=key)


def test_same_size_fields_would_swap_silently() -> None:
    """The premise of the same-size cases: routes and support swapped decode cleanly."""
    arrays = _arrays(0, same_size=True)
    assert arrays[ROUTES].nbytes == arrays[SUPPORT].nbytes == arrays[SUPPORT_LOGPROBS].nbytes
    routes = pack_field(PackedField.ROUTED_EXPERTS, arrays[ROUTES])
    support = pack_field(PackedField.ROLLOUT_SAMPLE_SUPPORT, arrays[SUPPORT])
    routes["data"], support["data"] = support["data"], routes["data"]
    swapped = decode_packed_fields({ROUTES: routes, SUPPORT: support})
    assert not np.array_equal(swapped[ROUTES].reshape(-1), arrays[ROUTES].reshape(-1))
    np.testing.assert_array_equal(swapped[ROUTES].reshape(-1), arrays[SUPPORT].reshape(-1))


@pytest.mark.parametrize("same_size", [False, True], ids=["sizes-differ", "same-size"])
@pytest.mark.parametrize("fields", [REGISTRY, REVERSED], ids=["registry", "reversed"])
def test_support_before_routes_in_one_choice(same_size: bool, fields: tuple) -> None:
    arrays = _arrays(1, same_size=same_size)
    raw = orjson.dumps({"choices": [_choice(arrays, (SUPPORT, ROUTES, SUPPORT_LOGPROBS))]})
    doc = load_packed_body(raw, fields=fields)
    assert list(doc["choices"][0])[2:] == [SUPPORT, ROUTES, SUPPORT_LOGPROBS]
    _assert_decodes_to(doc["choices"][0], arrays)


@pytest.mark.parametrize("same_size", [False, True], ids=["sizes-differ", "same-size"])
@pytest.mark.parametrize("fields", [REGISTRY, REVERSED], ids=["registry", "reversed"])
def test_each_choice_its_own_field_order(same_size: bool, fields: tuple) -> None:
    orders = [
        (ROUTES, SUPPORT, SUPPORT_LOGPROBS),  # the registry's (and the server's) order
        (SUPPORT, ROUTES, SUPPORT_LOGPROBS),
        (SUPPORT_LOGPROBS, SUPPORT, ROUTES),
        (SUPPORT, SUPPORT_LOGPROBS, ROUTES),
    ]
    arrays = [_arrays(10 + i, same_size=same_size) for i in range(len(orders))]
    choices = [_choice(a, order) for a, order in zip(arrays, orders, strict=True)]
    doc = load_packed_body(orjson.dumps({"choices": choices}), fields=fields)
    for i, expected in enumerate(arrays):
        _assert_decodes_to(doc["choices"][i], expected)


@pytest.mark.parametrize("same_size", [False, True], ids=["sizes-differ", "same-size"])
def test_usual_order_with_the_fields_argument_reversed(same_size: bool) -> None:
    arrays = [_arrays(20 + i, same_size=same_size) for i in range(2)]
    choices = [_choice(a, (ROUTES, SUPPORT, SUPPORT_LOGPROBS)) for a in arrays]
    raw = orjson.dumps({"choices": choices})
    for fields in (REVERSED, (SUPPORT_LOGPROBS, ROUTES, SUPPORT)):
        doc = load_packed_body(raw, fields=fields)
        for i, expected in enumerate(arrays):
            _assert_decodes_to(doc["choices"][i], expected)


EMPTY_ROUTES = np.zeros((0, 3, 2), dtype=np.uint8)
EMPTY_SUPPORT = np.zeros((0, 3), dtype=np.int32)


def test_an_empty_data_string_alone() -> None:
    choice = {"token_ids": [], ROUTES: pack_field(PackedField.ROUTED_EXPERTS, EMPTY_ROUTES)}
    raw = orjson.dumps({"choices": [choice], "model": "m"})
    assert b'"data":""' in raw
    doc = load_packed_body(raw)
    data = doc["choices"][0][ROUTES]["data"]
    assert isinstance(data, memoryview) and data.nbytes == 0
    assert doc["model"] == "m" and doc["choices"][0][ROUTES]["shape"] == [0, 3, 2]
    _assert_decodes_to(doc["choices"][0], {ROUTES: EMPTY_ROUTES})


@pytest.mark.parametrize("empty_first", [True, False], ids=["empty-first", "empty-second"])
def test_an_empty_data_string_next_to_another_packed_field(empty_first: bool) -> None:
    arrays = {
        ROUTES: np.arange(12, dtype=np.uint8).reshape(2, 3, 2),
        SUPPORT: EMPTY_SUPPORT,
        SUPPORT_LOGPROBS: np.zeros((0, 3), dtype=np.float32),
        TOKEN_IDS: np.array([7, 8, 9], dtype=np.int32),
    }
    order = (SUPPORT, SUPPORT_LOGPROBS, ROUTES, TOKEN_IDS)
    if not empty_first:
        order = (ROUTES, TOKEN_IDS, SUPPORT, SUPPORT_LOGPROBS)
    second = _choice({ROUTES: arrays[ROUTES]}, (ROUTES,))
    raw = orjson.dumps({"choices": [_choice(arrays, order), second]})
    assert raw.count(b'"data":""') == 2
    doc = load_packed_body(raw)
    _assert_decodes_to(doc["choices"][0], arrays)
    _assert_decodes_to(doc["choices"][1], {ROUTES: arrays[ROUTES]})
