"""End to end with ``trainer.strategy=fsdp``: a 3-step GRPO run with R3 on a checkpoint of
each family (transformers' own model classes, routes replayed by the gate hooks), the
weights pushed to the builtin engine and the served-weights check after every push
(``SMALL``), a checkpoint every step, an evaluation and the end-of-run Hugging Face
export. OLMoE and Mixtral run fully async (generation one step ahead, TIS), so the
backend is shown to change nothing in either loop; Mixtral trains packed
(``trainer.remove_microbatch_padding``) in token-budget microbatches.

The export is checked as ``test_main_base_families.py`` checks Megatron's, against an
oracle that shares nothing with the export path: the rank file's tensors loaded into
a fresh transformers model.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray
from _e2e import SMALL, with_overrides
from _export_checks import check_export

from inference.models.tiny_checkpoint import write_tiny_checkpoint
from skyrl_train.config.compose import load_config
from skyrl_train.entrypoints.main_base import run

pytestmark = pytest.mark.slow

STEPS = 3
ASYNC = ("olmoe", "mixtral")
PACKED = "mixtral"


# Every family trains on FSDP at worker level in the suite (test_fsdp_families.py), and
# Qwen2-MoE and OLMoE launch on Megatron there (test_main_base_families.py): the suite
# launches one synchronous and one fully async family on FSDP, the other two run in
# scripts/by_hand_checks.sh.
@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        pytest.param("qwen2_moe", marks=pytest.mark.by_hand),
        pytest.param("olmoe", marks=pytest.mark.by_hand),
        "mixtral",
    ],
)
def test_three_fsdp_steps_on_a_checkpoint_of_each_family(tmp_path: Path, family: str) -> None:
    fully_async = family in ASYNC
    folder = write_tiny_checkpoint(family, tmp_path / family, seed=0)
    run_dir = tmp_path / "run"
    cfg = load_config(
        with_overrides(
            SMALL,
            "trainer.strategy=fsdp",
            f"trainer.num_steps={STEPS}",
            "trainer.eval_interval=3",
            f"model.path={folder}",
            f"trainer.run_dir={run_dir}",
            "logging.plot=false",
            f"trainer.fully_async.enabled={str(fully_async).lower()}",
            f"trainer.algorithm.use_tis={str(fully_async).lower()}",
            # Mixtral also trains packed, in token-budget microbatches: the FSDP packed
            # path through a whole run (async, checkpoints, evaluation, export).
            f"trainer.remove_microbatch_padding={str(family == PACKED).lower()}",
            f"trainer.max_tokens_per_microbatch={48 if family == PACKED else -1}",
        )
    )
    history = run(cfg)
    assert len(history) == STEPS
    for metrics in history:
        for key in ("reward/mean", "train/policy_loss", "train/grad_norm", "policy/entropy"):
            assert math.isfinite(metrics[key]), (key, metrics[key])
        # Every MoE layer of every token routed as the engine did, dense first layer or not.
        assert metrics["r3/router_agreement_trained"] == 1.0
        assert metrics["r3/num_token_layers"] > 0
    assert "eval/reward_mean" in history[-1]
    if fully_async:
        assert [int(m["async/trained_version"]) for m in history] == list(range(STEPS))
        assert max(m["async/staleness_max"] for m in history) == 1
    # The weights moved (the served-weights check after every push would have stopped
    # the run had the engine not served them).
    assert history[-1]["policy/kl_to_ref"] > 0
    assert not ray.is_initialized()
    delta = check_export(
        run_dir / "exports" / f"global_step_{STEPS}",
        folder,
        run_dir / "checkpoints" / f"step_{STEPS:06d}",
        tmp_path,
    )
    print(f"{family}: fsdp export vs trainer checkpoint max |logits delta| {delta:.3g}")
