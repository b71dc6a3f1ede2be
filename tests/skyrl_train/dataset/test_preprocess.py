"""convert_to_training_batch: SkyRL layout, dtypes, R3 on/off, loud per-field errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from skyrl_train.dataset import preprocess
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.dataset.preprocess import convert_to_training_batch
from skyrl_train.dataset.route_rows import PackedRouteRows
from skyrl_train.errors import CollationError
from skyrl_train.generators.base import GeneratorOutput

PAD = 99


def _output(*, routes: bool = True, logprobs: bool = True) -> GeneratorOutput:
    rng = np.random.default_rng(1)
    prompts = [[1, 2, 3], [4], [5, 6]]
    responses = [[7, 8], [9, 10, 11, 12], []]
    loss_masks = [[1, 1], [1, 0, 0, 1], []]
    return GeneratorOutput(
        prompt_token_ids=prompts,
        response_ids=responses,
        loss_masks=loss_masks,
        rewards=[1.0, 0.0, -0.5],
        token_rewards=[[0.0, 1.0], [0.0, 0.0, 0.0, 0.0], []],
        stop_reasons=["stop", "length", "stop"],
        rollout_metrics={},
        rollout_logprobs=[[-0.5, -0.25], [-1.0, 0.0, 0.0, -2.0], []] if logprobs else None,
        routed_experts=[
            rng.integers(0, 8, size=(4, 2, 2), dtype=np.uint8),  # last token uncaptured
            rng.integers(0, 300, size=(5, 2, 2), dtype=np.int16),  # all 5 tokens
            rng.integers(0, 8, size=(1, 2, 2), dtype=np.uint8),  # prompt token 1 uncaptured
        ]
        if routes
        else None,
    )


def _reference(out: GeneratorOutput) -> dict[str, np.ndarray]:
    """Row by row with Python lists: prompt left-padded, response right-padded."""
    p_w = max(len(p) for p in out.prompt_token_ids)
    r_w = max(len(r) for r in out.response_ids)
    ref: dict[str, list] = {k: [] for k in ("seq", "attn", "resp", "loss", "trew", "lp")}
    for p, r, lm, tr, lp in zip(
        out.prompt_token_ids,
        out.response_ids,
        out.loss_masks,
        out.token_rewards,
        out.rollout_logprobs or [[0.0] * len(r) for r in out.response_ids],
        strict=True,
    ):
        left, right = p_w - len(p), r_w - len(r)
        ref["seq"].append([PAD] * left + p + r + [PAD] * right)
        ref["attn"].append([0] * left + [1] * (len(p) + len(r)) + [0] * right)
        ref["resp"].append([1] * len(r) + [0] * right)
        ref["loss"].append(list(lm) + [0] * right)
        ref["trew"].append(list(tr) + [0.0] * right)
        ref["lp"].append(list(lp) + [0.0] * right)
    return {k: np.array(v) for k, v in ref.items()}


@pytest.mark.parametrize("workers", [1, 2])
def test_layout_and_dtypes(workers: int) -> None:
    out = _output()
    batch = convert_to_training_batch(out, pad_token_id=PAD, workers=workers)
    ref = _reference(out)
    assert isinstance(batch, TrainingBatch)
    assert batch.batch_size == 3 and batch.num_actions == 4
    expected = {
        "sequences": (ref["seq"], torch.int64),
        "attention_mask": (ref["attn"], torch.int64),
        "response_mask": (ref["resp"], torch.int64),
        "loss_mask": (ref["loss"], torch.int64),
        "token_rewards": (ref["trew"], torch.float32),
        "rollout_logprobs": (ref["lp"], torch.float32),
        "rewards": (np.array([1.0, 0.0, -0.5]), torch.float32),
    }
    for name, (want, dtype) in expected.items():
        got = getattr(batch, name)
        assert got.dtype == dtype, name
        assert np.array_equal(got.numpy(), want.astype(got.numpy().dtype)), name

    # Packed by row on the way to the ranks; its rectangle is what a padded backend runs.
    assert isinstance(batch.routed_experts, PackedRouteRows)
    assert batch.routed_experts.cu_seqlens.tolist() == [0, 5, 10, 12]
    assert batch.routed_experts.values.shape == (12, 2, 2)
    routes = batch.routed_experts.rectangle()
    assert routes.dtype == torch.int16 and routes.shape == (3, 7, 2, 2)
    # Trajectory 0: prompt 3 at columns 0-2, response tokens at 3-4; token 4 uncaptured.
    src = out.routed_experts
    assert torch.equal(routes[0, 0:4], torch.from_numpy(src[0].astype(np.int16)))
    # Trajectory 1: prompt at column 2, response at 3-6.
    assert torch.equal(routes[1, 2:7], torch.from_numpy(src[1]))
    # Trajectory 2: prompt at 1-2, only token 0 captured.
    assert torch.equal(routes[2, 1], torch.from_numpy(src[2][0].astype(np.int16)))
    pad_mask = batch.router_padding_mask
    assert pad_mask.dtype == torch.bool
    assert pad_mask.tolist() == [
        [False, False, False, False, True, True, True],
        [True, True, False, False, False, False, False],
        [True, False, True, True, True, True, True],
    ]
    padding = routes[pad_mask]
    assert torch.equal(padding, torch.arange(2, dtype=torch.int16).expand_as(padding))
    # Observation tokens (loss mask 0) of trajectory 1 still replay.
    assert not pad_mask[1, 4:6].any() and batch.loss_mask[1, 1:3].eq(0).all()


def test_r3_off_and_no_logprobs() -> None:
    batch = convert_to_training_batch(_output(routes=False, logprobs=False), pad_token_id=0)
    assert batch.routed_experts is None
    assert batch.router_padding_mask is None
    assert batch.rollout_logprobs is None
    assert batch.sequences.shape == (3, 7)


def test_numpy_inputs_are_accepted() -> None:
    out = _output()
    as_arrays = dataclasses.replace(
        out,
        prompt_token_ids=[np.array(p, dtype=np.int32) for p in out.prompt_token_ids],
        loss_masks=[np.array(m, dtype=bool) for m in out.loss_masks],
    )
    got = convert_to_training_batch(as_arrays, pad_token_id=PAD)
    want = convert_to_training_batch(out, pad_token_id=PAD)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.loss_mask, want.loss_mask)


def _no_fill(*args, **kwargs):
    raise AssertionError("rows were filled before validation finished")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"prompt_token_ids": []}, r"prompt_token_ids: expected at least one trajectory, got 0"),
        ({"response_ids": [[7], [9]]}, r"response_ids: expected 3 entries .*, got 2"),
        ({"rewards": [1.0, 2.0]}, r"rewards: expected 3 entries .*, got 2"),
        (
            {"stop_reasons": "stop"},
            r"stop_reasons: expected a list with one entry per trajectory, got str",
        ),
        ({"rollout_logprobs": [[-0.5, -0.25]]}, r"rollout_logprobs: expected 3 entries .*, got 1"),
        ({"routed_experts": []}, r"routed_experts: expected 3 entries .*, got 0"),
        ({"rewards": [1.0, float("nan"), 0.0]}, r"rewards\[1\]: expected a finite number, got nan"),
        (
            {"prompt_token_ids": [[1, 2, 3], [], [5, 6]]},
            r"prompt_token_ids\[1\]: expected at least 1 token\(s\), got 0",
        ),
        (
            {"prompt_token_ids": [[1, 2, 3], [-4], [5, 6]]},
            r"prompt_token_ids\[1\]: expected token ids >= 0, got -4",
        ),
        (
            {"prompt_token_ids": [[1, 2, 3], [4.0], [5, 6]]},
            r"prompt_token_ids\[1\]: expected a flat list of int/uint values, got float64",
        ),
        (
            {"response_ids": [[7, 8], [9, [10]], []]},
            r"response_ids\[1\]: expected a flat list of numbers",
        ),
        ({"response_ids": [[7, 8], "9 10", []]}, r"response_ids\[1\]: expected a list, got str"),
        (
            {"loss_masks": [[1, 1], [1, 0, 0], []]},
            r"loss_masks\[1\]: expected 4 values \(one per response token\), got 3",
        ),
        (
            {"loss_masks": [[1, 2], [1, 0, 0, 1], []]},
            r"loss_masks\[0\]: expected values in \{0, 1\}, got \[1, 2\]",
        ),
        (
            {"loss_masks": [[1, 1], [1, -1, 0, 1], []]},
            r"loss_masks\[1\]: expected values in \{0, 1\}, got \[-1, 0, 1\]",
        ),
        (
            {"token_rewards": [[0.0, 1.0], [0.0] * 4, [0.0]]},
            r"token_rewards\[2\]: expected 0 values",
        ),
        (
            {"rollout_logprobs": [[-0.5], [-1.0] * 4, []]},
            r"rollout_logprobs\[0\]: expected 2 values \(one per response token\), got 1",
        ),
        (
            {"rollout_logprobs": [[-0.5, float("inf")], [-1.0] * 4, []]},
            r"rollout_logprobs\[0\]: expected finite values, got 1 non-finite",
        ),
    ],
)
def test_bad_fields_are_named(change: dict, match: str, monkeypatch) -> None:
    monkeypatch.setattr(preprocess, "fill_batch_rows", _no_fill)
    with pytest.raises(CollationError, match=match):
        convert_to_training_batch(dataclasses.replace(_output(), **change), pad_token_id=PAD)


@pytest.mark.parametrize(
    ("index", "bad", "match"),
    [
        (
            1,
            np.zeros((5, 2, 2), np.float32),
            r"routed_experts\[1\]\.dtype: expected one of uint8/int16/int32",
        ),
        (2, np.zeros((5, 2, 2), np.bool_), r"routed_experts\[2\]\.dtype"),
        (
            1,
            np.zeros((6, 2, 2), np.uint8),
            r"routed_experts\[1\]\.shape\[0\]: expected 1 <= rows <= 5",
        ),
        (0, "routes", r"routed_experts\[0\]: expected a numpy.ndarray"),
    ],
)
def test_bad_routes_are_named(index: int, bad, match: str, monkeypatch) -> None:
    monkeypatch.setattr(preprocess, "fill_batch_rows", _no_fill)
    out = _output()
    out.routed_experts[index] = bad
    with pytest.raises(CollationError, match=match):
        convert_to_training_batch(out, pad_token_id=PAD)


def test_bad_call_arguments(monkeypatch) -> None:
    monkeypatch.setattr(preprocess, "fill_batch_rows", _no_fill)
    with pytest.raises(TypeError, match=r"output: expected GeneratorOutput, got dict"):
        convert_to_training_batch({}, pad_token_id=0)
    with pytest.raises(ValueError, match=r"pad_token_id: expected an int >= 0, got -1"):
        convert_to_training_batch(_output(), pad_token_id=-1)
    with pytest.raises(ValueError, match=r"workers: expected an int >= 1, got 0"):
        convert_to_training_batch(_output(), pad_token_id=0, workers=0)
