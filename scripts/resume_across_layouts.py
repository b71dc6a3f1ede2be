"""Issue 39's check of resharding at launch, run by hand (docs/parallel-layouts.md,
"Resharding"): a run saved at step 2 under one layout resumes under another to step 4,
and its steps 3 and 4 are set beside the uninterrupted run's.

    OMP_NUM_THREADS=1 python scripts/resume_across_layouts.py

Layouts: TP=1 (one rank), TP=2 + SP and PP=2 x VPP=2 (two ranks each), the built-in
model, fp32 rollouts (the tests' tiny launch settings). From TP=1 to each of the other
two, and from each of them back to TP=1: six launches, a few minutes on 2 cores. The
suite runs the TP=2 -> TP=1 case (``test_main_base_tensor_parallel.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "skyrl_train" / "entrypoints"))

MC = "trainer.policy.megatron_config"
LAYOUTS = {
    "TP=1": ["trainer.placement.num_trainers=1", "trainer.placement.cpus_per_trainer=1"],
    "TP=2": [
        "trainer.placement.num_trainers=2",
        "trainer.placement.cpus_per_trainer=0.5",
        f"{MC}.tensor_model_parallel_size=2",
    ],
    "PP=2 x VPP=2": [
        "trainer.placement.num_trainers=2",
        "trainer.placement.cpus_per_trainer=0.5",
        f"{MC}.pipeline_model_parallel_size=2",
        f"{MC}.virtual_pipeline_model_parallel_size=2",
    ],
}
RUNS = [("TP=1", "TP=2"), ("TP=1", "PP=2 x VPP=2"), ("TP=2", "TP=1"), ("PP=2 x VPP=2", "TP=1")]


def _folder(name: str) -> str:
    """A folder name Hydra's override grammar takes (no '=' or spaces)."""
    return name.replace("=", "").replace(" ", "")


KEYS = ("reward/mean", "train/policy_loss", "train/grad_norm", "policy/entropy")


def _args(layout: str, run_dir: Path, *extra: str) -> list[str]:
    from _e2e import SMALL, with_overrides

    return with_overrides(
        SMALL,
        "trainer.num_steps=4",
        "trainer.eval_interval=0",
        "trainer.hf_save_interval=0",
        "trainer.micro_train_batch_size_per_gpu=2",
        "trainer.micro_forward_batch_size_per_gpu=2",
        "logging.plot=false",
        f"trainer.run_dir={run_dir}",
        *LAYOUTS[layout],
        *extra,
    )


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    logging.basicConfig(level=logging.WARNING)
    from skyrl_train.config.compose import load_config
    from skyrl_train.entrypoints.main_base import run

    with tempfile.TemporaryDirectory() as tmp:
        whole: dict[str, list[dict[str, float]]] = {}
        for src, dst in RUNS:
            if src not in whole:
                whole[src] = run(load_config(_args(src, Path(tmp) / _folder(src))))
            checkpoint = Path(tmp) / _folder(src) / "checkpoints" / "step_000002"
            resumed_dir = Path(tmp) / _folder(f"{src}-{dst}")
            resumed = run(load_config(_args(dst, resumed_dir, f"trainer.resume_from={checkpoint}")))
            print(f"\nsaved under {src} at step 2, resumed under {dst}:")
            print(
                f"{'step':<5} {'metric':<18} {'uninterrupted':>14} {'resumed':>14} {'rel diff':>9}"
            )
            for step, (want, got) in enumerate(zip(whole[src][2:], resumed, strict=True), 3):
                for key in KEYS:
                    rel = abs(got[key] - want[key]) / max(abs(want[key]), 1e-12)
                    print(f"{step:<5} {key:<18} {want[key]:>14.8f} {got[key]:>14.8f} {rel:>9.1e}")


if __name__ == "__main__":
    main()
