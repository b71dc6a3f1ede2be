"""The default run at TP=1, TP=2 (sequence parallel) and TP=2 x EP=2 (expert tensor size
1), with R3 on one seed: router agreement and the rollout-vs-trainer mismatch side by
side, each mismatch as a ratio to TP=1's (issue 39's target: agreement 1.0 and a
mismatch at most 1.5x TP=1's; docs/parallel-layouts.md).

    OMP_NUM_THREADS=1 python scripts/bench_layout_launches.py [--steps 3] [overrides ...]

Each layout launches the embedded default (``configs/ppo_base_config.yaml``) plus the
overrides, in a run folder of its own under a temporary directory. The same seed gives
every layout the same prompts and first rollouts; later steps sample from weights that
differ by each layout's rounding, so their batches may differ.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_train.config.compose import load_config  # noqa: E402
from skyrl_train.entrypoints.main_base import run  # noqa: E402
from skyrl_train.utils.cpu_topology import cpu_model  # noqa: E402

MC = "trainer.policy.megatron_config"
TWO_RANKS = ["trainer.placement.num_trainers=2", "trainer.placement.cpus_per_trainer=0.5"]
LAYOUTS: dict[str, list[str]] = {
    "TP=1": [],
    "TP=2": [*TWO_RANKS, f"{MC}.tensor_model_parallel_size=2"],
    "TP=2 x EP=2 (ETP=1)": [
        *TWO_RANKS,
        f"{MC}.tensor_model_parallel_size=2",
        f"{MC}.expert_model_parallel_size=2",
        f"{MC}.expert_tensor_parallel_size=1",
    ],
}
AGREEMENT = "r3/router_agreement_trained"
MISMATCH = "mismatch_trained/mean_abs_logp_diff"
MAX_RATIO = 1.5


@dataclass(frozen=True)
class LayoutResult:
    layout: str
    agreement: list[float]
    """Per step: the share of routed (token, layer) pairs the trainer replayed."""
    mismatch: list[float]
    """Per step: mean |logp_rollout - logp_trainer| over the trained tokens."""
    seconds: float

    @property
    def mean_mismatch(self) -> float:
        return statistics.fmean(self.mismatch)


def launch_layout(layout: str, *, steps: int, overrides: list[str], root: Path) -> LayoutResult:
    run_dir = root / layout.replace(" ", "").replace("=", "").replace("(", "_").replace(")", "")
    cfg = load_config(
        [
            *overrides,
            *LAYOUTS[layout],
            f"trainer.num_steps={steps}",
            "trainer.seed=0",
            "trainer.policy.routing_replay.enabled=true",
            "trainer.policy.routing_replay.source=rollout",
            "logging.plot=false",
            f"trainer.run_dir={run_dir}",
        ]
    )
    start = time.perf_counter()
    history = run(cfg)
    return LayoutResult(
        layout,
        agreement=[m[AGREEMENT] for m in history],
        mismatch=[m[MISMATCH] for m in history],
        seconds=time.perf_counter() - start,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args, overrides = parser.parse_known_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            results.append(
                launch_layout(layout, steps=args.steps, overrides=overrides, root=Path(tmp))
            )
    base = results[0].mean_mismatch
    print(f"{cpu_model()}, {os.cpu_count()} cpus; {args.steps} steps, seed 0, R3")
    print(f"overrides: {overrides or 'none'}")
    print(
        f"{'layout':22s}{'agreement (min)':>17s}{'mean |dlogp| per step':>34s}"
        f"{'mean':>10s}{'/ TP=1':>8s}{'wall s':>8s}"
    )
    failed = False
    for r in results:
        ratio = r.mean_mismatch / base if base > 0 else float("nan")
        ok = min(r.agreement) == 1.0 and ratio <= MAX_RATIO
        failed |= not ok
        per_step = " ".join(f"{m:.5f}" for m in r.mismatch)
        print(
            f"{r.layout:22s}{min(r.agreement):>17.4f}{per_step:>34s}"
            f"{r.mean_mismatch:>10.5f}{ratio:>8.3f}{r.seconds:>8.0f}" + ("" if ok else "  MISSED")
        )
    print(f"target: agreement 1.0 and mismatch <= {MAX_RATIO}x TP=1's")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
