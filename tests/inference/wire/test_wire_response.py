"""Server-side writer and the logprob clamp."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
import torch

from inference.errors import WireError
from inference.wire import (
    LOGPROB_FLOOR,
    clamp_logprobs,
    decode_packed_fields,
    dumps_generate_response,
    load_packed_body,
)


def test_clamp_counts_missing_and_non_finite() -> None:
    out = clamp_logprobs([-0.5, None, math.nan, math.inf, -math.inf, 0.0])
    assert out.values == [-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR, LOGPROB_FLOOR, LOGPROB_FLOOR, 0.0]
    assert out.num_clamped == 4
    values, count = clamp_logprobs([])
    assert values == [] and count == 0
    assert LOGPROB_FLOOR == -9999.0


def test_dumps_packs_arrays_data_first_and_keeps_order() -> None:
    routes = torch.tensor([[[1, 300]], [[2, 3]]])
    raw = dumps_generate_response(
        [
            {
                "token_ids": [5, 6],
                "routed_experts": routes,
                "packed_token_ids": np.array([5, 6]),
                "packed_logprobs": np.array([-0.25, LOGPROB_FLOOR]),
                "finish_reason": "length",
                "logprobs": None,
            },
            {"token_ids": [], "routed_experts": None},
        ],
        extra={"model": "tiny"},
    )
    assert b'"routed_experts":{"data":"' in raw
    doc = orjson.loads(raw)
    assert list(doc) == ["choices", "model"]
    assert list(doc["choices"][0]) == [
        "token_ids",
        "routed_experts",
        "packed_token_ids",
        "packed_logprobs",
        "finish_reason",
        "logprobs",
    ]
    assert doc["choices"][0]["routed_experts"]["dtype"] == "int16"  # canonical for 300
    out = decode_packed_fields(load_packed_body(raw)["choices"][0])
    np.testing.assert_array_equal(out["routed_experts"], routes.numpy())
    np.testing.assert_array_equal(out["packed_token_ids"], [5, 6])
    assert doc["choices"][1]["routed_experts"] is None


def test_dumps_refuses_bad_arrays_with_the_path() -> None:
    with pytest.raises(WireError, match=r"\$\.choices\[1\]\.routed_experts: expected non-negative"):
        dumps_generate_response([{}, {"routed_experts": np.full((1, 1, 1), -1)}])
    with pytest.raises(ValueError, match="choices"):
        dumps_generate_response([], extra={"choices": []})
