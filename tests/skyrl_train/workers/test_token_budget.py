"""``trainer.max_tokens_per_microbatch`` on the trainer's side (``trainer/microbatch_plan.py``,
``trainer/policy.py``): every rank runs the same number of microbatches whatever its
rows' lengths (agreed with one all-reduce MAX: a fake one over threads, then a real
gloo group of two processes), and the step stays the mini-batch's token mean whatever
the plan. The same batch trained through ``PolicyTrainer`` on the real Megatron worker
by rows and by two token budgets (other counts, rows reordered) gives the same loss,
grad norm and weights, and R3 still replays every row's own routes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from _megatron_batches import PAD_ID, make_batch, random_routes
from _ranks import run_group
from _step_checks import clipped_grads, steady_worst

from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.compose import load_config
from skyrl_train.config.schema import OptimizerConfig
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.trainer.microbatch_plan import microbatch_plan
from skyrl_train.trainer.policy import PolicyTrainer
from skyrl_train.workers.microbatches import MicrobatchPlan

CFG = TinyMoEConfig()
PROMPTS, SAMPLES = 4, 2
ROWS = PROMPTS * SAMPLES


def _masked(lengths: list[int], width: int = 12) -> TrainingBatch:
    """A stand-in batch whose rows hold ``lengths`` real tokens (left padded): all the
    plan reads is the attention mask."""
    mask = (torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]).long()
    return TrainingBatch(
        sequences=torch.ones_like(mask),
        attention_mask=mask,
        response_mask=mask[:, -2:],
        loss_mask=mask[:, -2:],
        rewards=torch.zeros(len(lengths)),
        token_rewards=torch.zeros(len(lengths), 2),
    )


# Rank 0 has short rows (one microbatch of 12 under a budget of 12 tokens), rank 1
# long ones (each over half the budget: four microbatches).
SHORT, LONG = [3, 2, 4, 3], [7, 11, 9, 12]


def _two_ranks(budget: int) -> list[MicrobatchPlan]:
    """Both ranks' plans, each rank on its own thread, their counts met through a fake
    all-reduce MAX (a barrier): what the process group does between processes."""
    barrier, seen = threading.Barrier(2), [0, 0]
    plans: list[MicrobatchPlan | None] = [None, None]

    def rank(r: int, lengths: list[int]) -> None:
        def max_over_ranks(count: int) -> int:
            seen[r] = count
            barrier.wait(timeout=30)
            return max(seen)

        plans[r] = microbatch_plan(
            _masked(lengths),
            micro_batch_size=2,
            max_tokens_per_microbatch=budget,
            max_over_ranks=max_over_ranks,
        )

    threads = [threading.Thread(target=rank, args=(r, x)) for r, x in enumerate((SHORT, LONG))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [p for p in plans if p is not None]


def test_every_rank_runs_the_count_the_longest_rows_need() -> None:
    plans = _two_ranks(12)
    assert len(plans) == 2  # both ranks got through the all-reduce
    short, long = plans
    assert MicrobatchPlan.by_tokens(SHORT, max_tokens=12).count == 1
    assert short.count == long.count == 4  # the short rank split to rank 1's count
    for plan, lengths in ((short, SHORT), (long, LONG)):
        assert sorted(r for g in plan.groups for r in g) == [0, 1, 2, 3]
        for group in plan.groups:
            assert len(group) == 1 or sum(lengths[r] for r in group) <= 12


def test_without_a_budget_the_plan_is_by_rows_and_agrees_nothing() -> None:
    def no_collective(count: int) -> int:
        raise AssertionError("by rows, every rank has the same count: no all-reduce")

    plan = microbatch_plan(
        _masked(LONG),
        micro_batch_size=3,
        max_tokens_per_microbatch=-1,
        max_over_ranks=no_collective,
    )
    assert plan.groups == ((0, 1, 2), (3,))


def test_a_rank_with_fewer_rows_than_the_agreed_count_is_refused_naming_both() -> None:
    with pytest.raises(ValueError) as info:
        microbatch_plan(
            _masked(SHORT),
            micro_batch_size=2,
            max_tokens_per_microbatch=12,
            max_over_ranks=lambda count: 5,
        )
    message = str(info.value)
    assert message.startswith("trainer.max_tokens_per_microbatch: expected every rank")
    assert "agreed 5 microbatches, got 4 rows" in message


def _gloo_rank(rank: int) -> None:
    plan = microbatch_plan(
        _masked((SHORT, LONG)[rank]), micro_batch_size=2, max_tokens_per_microbatch=12
    )
    assert plan.count == 4, (rank, plan)


def test_two_gloo_ranks_agree_the_count_with_one_all_reduce(tmp_path: Path) -> None:
    run_group(_gloo_rank, args=(), nprocs=2, rendezvous=tmp_path / "rendezvous")


# ---- the token mean on the real worker ----------------------------------------------


def _batch() -> TrainingBatch:
    """Ragged rows (5 to 11 real tokens, prompts left padded), random rollout routes,
    advantages of both signs."""
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 200, (2 + (3 * b) % 5,), generator=gen).tolist() for b in range(ROWS)
    ]
    responses = [
        torch.randint(0, 200, (1 + (5 * b) % 6,), generator=gen).tolist() for b in range(ROWS)
    ]
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    moe, k = len(CFG.architecture().moe_layers), CFG.num_experts_per_tok
    routes = random_routes(ROWS, max(lengths), moe, CFG.num_experts, k, seed=1)
    batch = make_batch(
        prompts,
        responses,
        num_layers=moe,
        top_k=k,
        routes=[routes[b, : lengths[b]] for b in range(ROWS)],
        rollout_logprobs=[(-torch.rand(len(r), generator=gen)).tolist() for r in responses],
    )
    batch.advantages = torch.randn(ROWS, 1, generator=gen) * batch.loss_mask
    return batch


def _train(tmp_path: Path, budget: int) -> tuple[dict[str, float], PolicyTrainer]:
    from skyrl_train.workers.megatron import MegatronPolicyWorker

    torch.set_num_threads(1)
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.train_batch_size={PROMPTS}",
            # One optimizer step: after a first one, Adam's lr * g / |g| turns a 1e-9
            # difference in a near-zero gradient into 1e-2 in a weight, and a second
            # mini-batch's loss then differs by 5e-4 (measured) whatever the plan.
            f"trainer.policy_mini_batch_size={PROMPTS}",
            "trainer.micro_train_batch_size_per_gpu=4",
            "trainer.micro_forward_batch_size_per_gpu=4",
            f"trainer.max_tokens_per_microbatch={budget}",
            f"generator.n_samples_per_prompt={SAMPLES}",
            "trainer.ref.log_kl=false",
            "trainer.algorithm.use_entropy_loss=true",
            "trainer.algorithm.entropy_loss_coef=0.01",
        ]
    )
    trainer = PolicyTrainer(cfg, checkpoint=str(tmp_path), pad_token_id=PAD_ID)
    # A fresh worker each: the same seed gives the same initial weights and no Adam state.
    trainer.worker = MegatronPolicyWorker(
        CFG.architecture(),
        cfg.trainer.policy.megatron_config,
        optimizer=OptimizerConfig(lr=1e-2, max_grad_norm=1e3),
        pad_token_id=PAD_ID,
    ).setup()
    metrics = trainer.train(_batch(), step=1)
    return dict(metrics.items()), trainer


def test_the_step_is_the_token_mean_whatever_the_microbatch_plan(tmp_path: Path) -> None:
    batch = _batch()
    lengths = [int(n) for n in batch.attention_mask.sum(dim=1)]
    # By rows the 8-row mini-batch is 2 microbatches of 4 in order. 30 tokens: 2 as
    # well, of 5 and 3 rows out of order; 13: 5, rows out of order; 4: every row alone.
    budgets = {30: 2, 13: 5, 4: 8}
    for budget, count in budgets.items():
        plan = MicrobatchPlan.by_tokens(lengths, max_tokens=budget)
        assert plan.count == count and plan.is_consecutive == (budget == 4), plan
    want, rows = _train(tmp_path / "rows", -1)
    want_grads, want_weights = clipped_grads(rows.worker), dict(rows.worker.export_weights())
    for budget in budgets:
        got, tokens = _train(tmp_path / f"tokens{budget}", budget)
        assert abs(got["train/policy_loss"] - want["train/policy_loss"]) <= 1e-6, budget
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
        assert got["train/optimizer_steps"] == want["train/optimizer_steps"] == 1.0
        # R3 replayed each row's own routes although the plan reordered the rows.
        assert got["r3/router_agreement_trained"] == 1.0
        assert got["policy/entropy"] == pytest.approx(want["policy/entropy"], abs=1e-6)
        grads = clipped_grads(tokens.worker)
        assert max(float((grads[n] - want_grads[n]).abs().max()) for n in grads) <= 1e-5
        weights = dict(tokens.worker.export_weights())
        # Every row alone sums the gradient in another order: a -1.07e-6 element read
        # -1.22e-6 (measured), which AdamW's first step (lr * g / (|g| + 1e-8)) turns
        # into 1.1e-5 in its weight; from |g| >= 1e-5 on, such rounding moves <= 1e-6.
        steadier = {n: g.abs().ge(1e-5) * g for n, g in want_grads.items()}
        assert steady_worst(weights, want_weights, steadier) <= 1e-5
