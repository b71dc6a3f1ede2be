"""The client reads ``rollout_sample_support_size`` with the support and refuses a size
that contradicts the listed ids (a row lists min(size, k) of them)."""

from __future__ import annotations

import numpy as np
import pytest

from inference.client import GenerateResult
from inference.client.side_channels import decode_side_channels
from inference.errors import GenerateProtocolError
from inference.wire import PackedField, pack_field, pack_sample_support

IDS = np.array([[4, 9, -1], [7, 2, 5], [3, -1, -1]], dtype=np.int32)
LOGPROBS = np.where(IDS >= 0, -1.0, -np.inf).astype(np.float32)


def decode(sizes: np.ndarray | None) -> GenerateResult:
    ids, logprobs = pack_sample_support(IDS, LOGPROBS)
    choice = {"rollout_sample_support": ids, "rollout_sample_support_logprobs": logprobs}
    if sizes is not None:
        choice["rollout_sample_support_size"] = pack_field(
            PackedField.ROLLOUT_SAMPLE_SUPPORT_SIZE, sizes
        )
    result = GenerateResult(response_ids=[4, 2, 3], finish_reason="length", logprobs=None)
    decode_side_channels(
        choice, result, want_routes=False, want_support=True, expected_route_rows=None
    )
    return result


def test_sizes_come_back_with_the_support() -> None:
    result = decode(np.array([2, 40, 1]))  # row 1 is cut short: 40 kept, 3 listed
    assert result.sample_support_size.tolist() == [2, 40, 1]
    assert result.sample_support_size.dtype == np.int32


def test_a_server_without_sizes_still_decodes() -> None:
    assert decode(None).sample_support_size is None


@pytest.mark.parametrize(
    ("sizes", "path", "text"),
    [
        (np.array([2, 3]), "rollout_sample_support_size.shape[0]", "3 sizes"),
        (np.array([2, 40, 2]), "rollout_sample_support_size[2]", "the 1 listed ids"),
        (np.array([3, 40, 1]), "rollout_sample_support_size[0]", "the 2 listed ids"),
        (np.array([2, 2, 1]), "rollout_sample_support_size[1]", "the 3 listed ids"),
    ],
)
def test_a_size_that_contradicts_the_ids_is_refused(sizes, path: str, text: str) -> None:
    with pytest.raises(GenerateProtocolError) as info:
        decode(sizes)
    assert info.value.path == f"$.choices[0].{path}" and text in str(info.value)


def test_a_size_below_one_is_refused_by_the_wire() -> None:
    with pytest.raises(ValueError, match="kept-set sizes >= 1"):
        pack_field(PackedField.ROLLOUT_SAMPLE_SUPPORT_SIZE, np.array([1, 0, 1]))
