"""The backends' shared optimizer and schedule (``algorithms/optim``): AdamW from
``trainer.policy.optimizer_config``, the linear warm-up read from the optimizer's own
step count (so a loaded state resumes the ramp), and a step skipped on a non-finite
gradient norm. The Megatron worker's use of it: tests/skyrl_train/workers/
test_megatron_warmup.py."""

from __future__ import annotations

import pytest
import torch

from skyrl_train.algorithms.optim import (
    ADAM_EPS,
    build_optimizer,
    clip_to_norm_,
    optimizer_step,
    scheduled_lr,
    steps_taken,
)
from skyrl_train.config.schema import OptimizerConfig

LR = 0.1


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _backward(model: torch.nn.Linear) -> None:
    model.zero_grad()
    model(torch.ones(1, 3)).sum().backward()


def _take_steps(
    config: OptimizerConfig, optimizer: torch.optim.Optimizer, model: torch.nn.Linear, n: int
) -> list[float]:
    """``n`` optimizer steps at the schedule's rate; the rate of each, as taken."""
    rates = []
    for _ in range(n):
        rates.append(scheduled_lr(config, optimizer))
        _backward(model)
        assert optimizer_step(optimizer, lr=rates[-1], grad_norm=1.0)
        assert optimizer.param_groups[0]["lr"] == rates[-1]
    return rates


def test_adamw_takes_the_configs_settings() -> None:
    config = OptimizerConfig(lr=LR, adam_betas=[0.8, 0.95], weight_decay=0.01)
    optimizer = build_optimizer(_model().parameters(), config)
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"], group["eps"]) == (
        LR,
        (0.8, 0.95),
        0.01,
        ADAM_EPS,
    )


def test_the_warm_up_rises_per_step_and_resumes_from_a_loaded_state() -> None:
    config = OptimizerConfig(lr=LR, num_warmup_steps=4)
    model = _model()
    optimizer = build_optimizer(model.parameters(), config)
    rates = _take_steps(config, optimizer, model, 2)
    resumed = build_optimizer(model.parameters(), config)
    assert steps_taken(resumed) == 0
    resumed.load_state_dict(optimizer.state_dict())
    rates += _take_steps(config, resumed, model, 3)
    assert rates == pytest.approx([LR / 4, LR / 2, LR * 3 / 4, LR, LR], rel=1e-12)
    flat = OptimizerConfig(lr=LR, num_warmup_steps=0)
    assert scheduled_lr(flat, build_optimizer(model.parameters(), flat)) == LR


def test_the_decay_falls_linearly_to_min_lr_after_the_warm_up_and_resumes() -> None:
    config = OptimizerConfig(
        lr=LR, num_warmup_steps=2, num_stable_steps=0, lr_decay_steps=4, min_lr=LR / 10
    )
    model = _model()
    optimizer = build_optimizer(model.parameters(), config)
    rates = _take_steps(config, optimizer, model, 4)
    resumed = build_optimizer(model.parameters(), config)
    resumed.load_state_dict(optimizer.state_dict())
    rates += _take_steps(config, resumed, model, 4)
    step = (LR - LR / 10) / 4
    expected = [LR / 2, LR, LR, LR - step, LR - 2 * step, LR - 3 * step, LR / 10, LR / 10]
    assert rates == pytest.approx(expected, rel=1e-12)


def test_stable_steps_hold_the_peak_between_the_warm_up_and_the_decay() -> None:
    config = OptimizerConfig(lr=LR, num_warmup_steps=1, num_stable_steps=2, lr_decay_steps=2)
    model = _model()
    optimizer = build_optimizer(model.parameters(), config)
    rates = _take_steps(config, optimizer, model, 7)
    assert rates == pytest.approx([LR, LR, LR, LR, LR / 2, 0.0, 0.0], abs=1e-15)
    # A null decay outside a launch (no run to end): the rate stays at lr.
    unresolved = OptimizerConfig(lr=LR, num_stable_steps=0, lr_decay_steps=None)
    assert scheduled_lr(unresolved, optimizer) == LR


def test_a_non_finite_norm_takes_no_step() -> None:
    config = OptimizerConfig(lr=LR, num_warmup_steps=2)
    model = _model()
    optimizer = build_optimizer(model.parameters(), config)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    assert not optimizer_step(optimizer, lr=LR, grad_norm=float("nan"))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    # The skipped step does not advance the warm-up either.
    assert steps_taken(optimizer) == 0 and scheduled_lr(config, optimizer) == LR / 2
    assert optimizer_step(optimizer, lr=LR, grad_norm=2.0)
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_clip_to_norm_scales_only_a_finite_norm_above_the_limit() -> None:
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]  # global norm 5
    clip_to_norm_(grads, norm=5.0, max_norm=1.0)
    assert torch.allclose(torch.cat(grads).norm(), torch.tensor(1.0), atol=1e-6)
    for norm, limit in ((0.5, 1.0), (float("nan"), 1.0), (5.0, 0.0)):
        kept = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
        clip_to_norm_(kept, norm=norm, max_norm=limit)
        assert [g.tolist() for g in kept] == [[3.0, 0.0], [4.0]]
