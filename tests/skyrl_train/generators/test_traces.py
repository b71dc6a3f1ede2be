"""TokenMetadataTrace / RoutedExpertTrace: row counts, widening, prefix replies, finalize."""

from __future__ import annotations

import numpy as np
import pytest

from skyrl_train import RoutedExpertTrace, TokenMetadataTrace
from skyrl_train.errors import RouteTraceError

L, K = 3, 2


def routes(token_ids: range | list[int], dtype=np.uint8) -> np.ndarray:
    """Deterministic fake routes: token t's row is identifiable from t."""
    t = np.asarray(list(token_ids), dtype=np.int64)[:, None, None]
    return ((t * 7 + np.arange(L)[None, :, None] * 3 + np.arange(K)[None, None, :]) % 250).astype(
        dtype
    )


def test_multi_turn_stitching_matches_one_forward_of_the_final_sequence():
    trace = RoutedExpertTrace("traj-0", num_layers=L, top_k=K)
    # Turn 0: P=5, G=3 -> tokens 0..7, rows 0..6 (the last sampled token is not fed).
    assert trace.prompt_start == 0
    trace.record_generation(
        prompt_token_count=5, generated_token_count=3, routed_experts=routes(range(0, 7))
    )
    assert trace.prompt_start == 7
    # Turn 1: 4 observation tokens appended -> P=12, G=2 -> rows 7..12.
    trace.record_generation(
        prompt_token_count=12, generated_token_count=2, routed_experts=routes(range(7, 13))
    )
    assert trace.prompt_start == 13 and trace.turns == 2
    n = 14
    mask = [0] * 5 + [1] * 3 + [0] * 4 + [1] * 2
    result = trace.finalize(token_count=n, loss_mask=mask)
    np.testing.assert_array_equal(result.captured_routes, routes(range(13)))
    assert result.rows == 13 and result.captured.tolist() == [True] * 13 + [False]
    # One row per token; the uncaptured last token's row is arange(K) padding.
    assert result.routed_experts.shape == (n, L, K)
    np.testing.assert_array_equal(result.routed_experts[:13], routes(range(13)))
    np.testing.assert_array_equal(result.routed_experts[13], np.tile(np.arange(K), (L, 1)))
    routes_out, captured = result
    assert routes_out is result.routed_experts and captured is result.captured


def test_uint8_then_int16_widens_losslessly():
    trace = RoutedExpertTrace("traj-w")
    trace.record_generation(
        prompt_token_count=3, generated_token_count=2, routed_experts=routes(range(4))
    )
    wide = routes(range(4, 7), dtype=np.int16) + 300
    trace.record_generation(prompt_token_count=6, generated_token_count=2, routed_experts=wide)
    out = trace.finalize(token_count=8, loss_mask=[0, 0, 0, 1, 1, 0, 1, 1]).captured_routes
    assert out.dtype == np.int16
    np.testing.assert_array_equal(out[:4], routes(range(4)).astype(np.int16))
    np.testing.assert_array_equal(out[4:], wide)


def test_whole_prefix_reply_is_recognised_by_row_count_and_realigned():
    trace = RoutedExpertTrace("traj-p", num_layers=L, top_k=K)
    trace.record_generation(
        prompt_token_count=4, generated_token_count=2, routed_experts=routes(range(5))
    )
    # A server that ignored start=5 sends rows for tokens 0..8 (P=7, G=3 -> 9 rows).
    # Its prefix rows differ from ours (a re-forward may route differently); ours win.
    whole = routes(range(9))
    whole[:5] = 0
    trace.record_generation(prompt_token_count=7, generated_token_count=3, routed_experts=whole)
    assert trace.whole_prefix_replies == 1 and trace.prompt_start == 9
    out = trace.finalize(token_count=10, loss_mask=[0] * 4 + [1, 1, 0, 1, 1, 1]).captured_routes
    np.testing.assert_array_equal(out, routes(range(9)))


def test_other_row_counts_are_refused_naming_trajectory_and_turn():
    trace = RoutedExpertTrace("traj-x")
    trace.record_generation(
        prompt_token_count=4, generated_token_count=2, routed_experts=routes(range(5))
    )
    with pytest.raises(
        RouteTraceError,
        match=r"trajectory traj-x turn 1: routed_experts.rows: expected 4 .* or 9 \(whole prefix\), got 6",
    ):
        trace.record_generation(
            prompt_token_count=7, generated_token_count=3, routed_experts=routes(range(6))
        )
    with pytest.raises(
        RouteTraceError,
        match=r"trajectory traj-x turn 1: prompt_token_count: expected > prompt_start \(5\)",
    ):
        trace.record_generation(
            prompt_token_count=5, generated_token_count=1, routed_experts=routes(range(0))
        )
    with pytest.raises(
        RouteTraceError, match=r"turn 1: routed_experts: expected an array of 3 rows .*got None"
    ):
        trace.record_generation(prompt_token_count=7, generated_token_count=2, routed_experts=None)
    with pytest.raises(
        RouteTraceError,
        match=r"turn 1: routed_experts.shape\[1:\]: expected \(3, 2\) \(fixed\), got \(3, 1\)",
    ):
        trace.record_generation(
            prompt_token_count=7, generated_token_count=2, routed_experts=routes(range(3))[:, :, :1]
        )
    with pytest.raises(
        RouteTraceError, match=r"turn 1: routed_experts.dtype: expected a int dtype, got float32"
    ):
        trace.record_generation(
            prompt_token_count=7,
            generated_token_count=2,
            routed_experts=routes(range(3)).astype(np.float32),
        )
    with pytest.raises(
        RouteTraceError, match=r"turn 1: routed_experts: expected expert ids >= 0, got -1"
    ):
        trace.record_generation(
            prompt_token_count=7,
            generated_token_count=2,
            routed_experts=np.full((3, L, K), -1, np.int16),
        )
    with pytest.raises(
        RouteTraceError, match=r"turn 1: generated_token_count: expected an int >= 1, got 0"
    ):
        trace.record_generation(
            prompt_token_count=7, generated_token_count=0, routed_experts=routes(range(3))
        )
    # Nothing half-appended by the failures: the next good turn still lines up.
    assert trace.prompt_start == 5 and trace.turns == 1
    trace.record_generation(
        prompt_token_count=7, generated_token_count=2, routed_experts=routes(range(5, 8))
    )
    assert trace.prompt_start == 8


def test_trailing_eos_with_loss_mask_one_is_refused_and_with_zero_is_padding():
    """Single-turn path: P=4, G=3 -> rows 0..5; an appended EOS at t=7 needs row 6."""
    trace = RoutedExpertTrace("traj-eos")
    trace.record_generation(
        prompt_token_count=4, generated_token_count=3, routed_experts=routes(range(6))
    )
    with pytest.raises(
        RouteTraceError,
        match=r"trajectory traj-eos: loss_mask\[7\]: expected a captured route row 6.*got 6 rows.*EOS",
    ):
        trace.finalize(token_count=8, loss_mask=[0] * 4 + [1, 1, 1, 1])
    result = trace.finalize(token_count=8, loss_mask=[0] * 4 + [1, 1, 1, 0])
    assert result.rows == 6 and result.captured.tolist() == [True] * 6 + [False, False]
    # The engine's own sampled EOS (the last of G) is predicted from row 5: fine.
    assert trace.finalize(token_count=7, loss_mask=[0] * 4 + [1, 1, 1]).rows == 6


def test_finalize_truncates_rows_to_token_count_and_checks_the_mask():
    trace = RoutedExpertTrace("traj-t")
    trace.record_generation(
        prompt_token_count=4, generated_token_count=6, routed_experts=routes(range(9))
    )
    result = trace.finalize(token_count=6, loss_mask=[0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(result.routed_experts, routes(range(6)))
    assert result.captured.all()
    with pytest.raises(
        RouteTraceError,
        match=r"traj-t: loss_mask.shape: expected \(6,\) \(token_count\), got \(5,\)",
    ):
        trace.finalize(token_count=6, loss_mask=[0, 0, 0, 1, 1])
    with pytest.raises(
        RouteTraceError, match=r"traj-t: loss_mask\[0\]: expected a captured route row -1"
    ):
        trace.finalize(token_count=6, loss_mask=[1, 0, 0, 0, 1, 1])
    with pytest.raises(RouteTraceError, match="expected 0/1 values"):
        trace.finalize(token_count=6, loss_mask=[0, 0, 0, 0, 2, 1])


def test_empty_trace_finalizes_to_zero_rows():
    result = RoutedExpertTrace("traj-e", num_layers=L, top_k=K).finalize(
        token_count=3, loss_mask=[0, 0, 0]
    )
    assert result.captured_routes.shape == (0, L, K) and not result.captured.any()
    np.testing.assert_array_equal(result.routed_experts, np.tile(np.arange(K), (3, L, 1)))
    assert RoutedExpertTrace("traj-e2").finalize(
        token_count=0, loss_mask=[]
    ).routed_experts.shape == (0, 0, 0)


def test_token_metadata_trace_general_rules():
    trace = TokenMetadataTrace("traj-m", field="support", kind="int", trailing_shape=(4,))
    trace.append(np.zeros((2, 4), np.uint8), expected_rows=2, turn=0)
    trace.append(np.full((1, 4), -5, np.int8), expected_rows=1, turn=1)  # uint8+int8 -> int16
    assert trace.dtype == np.int16 and trace.num_rows == 3
    np.testing.assert_array_equal(trace.array()[2], [-5] * 4)
    assert trace.array(rows=1).shape == (1, 4)
    with pytest.raises(RouteTraceError, match=r"traj-m turn 2: support.rows: expected 3, got 2"):
        trace.append(np.zeros((2, 4), np.int16), expected_rows=3, turn=2)
    big = TokenMetadataTrace("traj-u", field="ids")
    big.append(np.zeros(2, np.uint64), expected_rows=2, turn=0)
    with pytest.raises(
        RouteTraceError,
        match=r"traj-u turn 1: ids.dtype: expected a lossless int widening of uint64, got int64 \(common type float64\)",
    ):
        big.append(np.zeros(2, np.int64), expected_rows=2, turn=1)
    floats = TokenMetadataTrace("traj-f", field="logprobs", kind="float")
    floats.append(np.zeros(3, np.float16), expected_rows=3, turn=0)
    floats.append(np.ones(1, np.float32), expected_rows=1, turn=1)
    assert floats.array().dtype == np.float32 and floats.array().tolist() == [0, 0, 0, 1]


def test_record_generation_takes_torch_routes_too():
    import torch

    trace = RoutedExpertTrace()
    trace.record_generation(
        prompt_token_count=3,
        generated_token_count=2,
        routed_experts=torch.from_numpy(routes(range(4)).astype(np.int16)),
    )
    routes_out, captured = trace.finalize(token_count=5, loss_mask=[0, 0, 0, 1, 1])
    np.testing.assert_array_equal(routes_out[:4], routes(range(4)))
    assert routes_out.dtype == np.int16 and captured.tolist() == [True] * 4 + [False]
