"""The default run at each layout with R3 on one seed, side by side: router agreement,
the rollout-vs-trainer mismatch (each as a ratio to its model's one-rank run: issue 39
and 51's target, agreement 1.0 and at most 1.5x) and the step time against one rank
(issue 51; docs/parallel-layouts.md).

    OMP_NUM_THREADS=1 python scripts/bench_layout_launches.py [--steps 3] \
        [--layout NAME ...] [overrides ...]

The built-in model at TP=1, TP=2 (sequence parallel) and TP=2 x EP=2 (ETP=1) on 2
ranks; ``model=tiny_layouts`` (8 heads, 8 experts, 8 layers) on one rank, at TP=2 x EP=2
and PP=2 x TP=2 and PP=4 on 4 ranks, and at slime's Qwen3-30B-A3B shape on 8 (TP=4 + SP,
EP=8, ETP=1). Each layout launches the embedded default (``configs/ppo_base_config.yaml``,
64 trajectories and 8 optimizer updates a step) plus the overrides, in a run folder of
its own under a temporary directory, without evaluation or exports. The same seed gives
every layout of a model the same prompts and first rollouts; later steps sample from
weights that differ by each layout's rounding, so their batches may differ.

Step time: ``timing/step_s`` (generation, the trainer's forward passes and updates, the
weight push) and ``timing/train_s`` (the trainer's part alone), each the mean over steps
2 onwards: step 1 carries the first pass's one-off costs (allocator warm-up, process
groups' first collectives). Ray's CPUs are split evenly: the engine holds 1, the
trainer ranks share the rest (``cpus_per_trainer`` = 1 / ranks).
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
LAYOUTS_MODEL = "model=tiny_layouts"


def ranks(n: int) -> list[str]:
    """``n`` trainer ranks in the one Ray CPU the engine leaves (ray.num_cpus=2)."""
    return [
        "ray.num_cpus=2",
        f"trainer.placement.num_trainers={n}",
        f"trainer.placement.cpus_per_trainer={1 / n:g}",
    ]


TP2_EP2 = [
    f"{MC}.tensor_model_parallel_size=2",
    f"{MC}.expert_model_parallel_size=2",
    f"{MC}.expert_tensor_parallel_size=1",
]


@dataclass(frozen=True)
class Layout:
    overrides: list[str]
    reference: str
    """The one-rank layout of the same model: the ratios' denominator."""


LAYOUTS: dict[str, Layout] = {
    "TP=1": Layout([], "TP=1"),
    "TP=2": Layout([*ranks(2), f"{MC}.tensor_model_parallel_size=2"], "TP=1"),
    "TP=2 x EP=2 (ETP=1)": Layout([*ranks(2), *TP2_EP2], "TP=1"),
    "layouts: 1 rank": Layout([LAYOUTS_MODEL], "layouts: 1 rank"),
    "layouts: TP=2 x EP=2 on 4": Layout([LAYOUTS_MODEL, *ranks(4), *TP2_EP2], "layouts: 1 rank"),
    "layouts: PP=2 x TP=2 on 4": Layout(
        [
            LAYOUTS_MODEL,
            *ranks(4),
            f"{MC}.pipeline_model_parallel_size=2",
            f"{MC}.tensor_model_parallel_size=2",
        ],
        "layouts: 1 rank",
    ),
    "layouts: PP=4 on 4": Layout(
        [LAYOUTS_MODEL, *ranks(4), f"{MC}.pipeline_model_parallel_size=4"], "layouts: 1 rank"
    ),
    "layouts: slime on 8": Layout(
        [
            LAYOUTS_MODEL,
            *ranks(8),
            f"{MC}.tensor_model_parallel_size=4",
            f"{MC}.expert_model_parallel_size=8",
            f"{MC}.expert_tensor_parallel_size=1",
        ],
        "layouts: 1 rank",
    ),
}
AGREEMENT = "r3/router_agreement_trained"
MISMATCH = "mismatch_trained/mean_abs_logp_diff"
MAX_RATIO = 1.5


STEP = "timing/step_s"
TRAIN = "timing/train_s"


@dataclass(frozen=True)
class LayoutResult:
    layout: str
    agreement: list[float]
    """Per step: the share of routed (token, layer) pairs the trainer replayed."""
    mismatch: list[float]
    """Per step: mean |logp_rollout - logp_trainer| over the trained tokens."""
    step_s: list[float]
    train_s: list[float]
    seconds: float
    """The launch's wall time: Ray, the ranks and the engine started and stopped."""

    @property
    def mean_mismatch(self) -> float:
        return statistics.fmean(self.mismatch)

    @property
    def mean_step_s(self) -> float:
        return _after_first(self.step_s)

    @property
    def mean_train_s(self) -> float:
        return _after_first(self.train_s)


def _after_first(per_step: list[float]) -> float:
    """The mean over steps 2 onwards (step 1 alone when the run had one step)."""
    return statistics.fmean(per_step[1:] or per_step)


def launch_layout(layout: str, *, steps: int, overrides: list[str], root: Path) -> LayoutResult:
    name = layout.replace(":", "").replace(" ", "").replace("=", "").replace("(", "_")
    cfg = load_config(
        [
            *overrides,
            *LAYOUTS[layout].overrides,
            f"trainer.num_steps={steps}",
            "trainer.seed=0",
            "trainer.policy.routing_replay.enabled=true",
            "trainer.policy.routing_replay.source=rollout",
            "trainer.eval_interval=0",
            "trainer.hf_save_interval=-1",
            "logging.plot=false",
            f"trainer.run_dir={root / name.replace(')', '')}",
        ]
    )
    start = time.perf_counter()
    history = run(cfg)
    return LayoutResult(
        layout,
        agreement=[m[AGREEMENT] for m in history],
        mismatch=[m[MISMATCH] for m in history],
        step_s=[m[STEP] for m in history],
        train_s=[m[TRAIN] for m in history],
        seconds=time.perf_counter() - start,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--layout",
        action="append",
        choices=list(LAYOUTS),
        help="one layout; repeat for more (each with its one-rank reference). Default: all",
    )
    args, overrides = parser.parse_known_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING)
    chosen = args.layout or list(LAYOUTS)
    wanted = {LAYOUTS[name].reference for name in chosen} | set(chosen)
    results: dict[str, LayoutResult] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in (name for name in LAYOUTS if name in wanted):
            results[layout] = launch_layout(
                layout, steps=args.steps, overrides=overrides, root=Path(tmp)
            )
    print(f"{cpu_model()}, {os.cpu_count()} cpus; {args.steps} steps, seed 0, R3")
    print(f"overrides: {overrides or 'none'}")
    print("step s, train s: mean over steps 2 onwards; x1: the ratio to the model's one rank")
    print(
        f"{'layout':27s}{'agree min':>10s}{'mean |dlogp| per step':>26s}{'mean':>9s}"
        f"{'x1':>7s}{'step s':>8s}{'x1':>7s}{'train s':>8s}{'x1':>7s}{'wall s':>7s}"
    )
    failed = False
    for r in results.values():
        ref = results[LAYOUTS[r.layout].reference]
        ratio = r.mean_mismatch / ref.mean_mismatch if ref.mean_mismatch > 0 else float("nan")
        ok = min(r.agreement) == 1.0 and ratio <= MAX_RATIO
        failed |= not ok
        per_step = " ".join(f"{m:.5f}" for m in r.mismatch)
        print(
            f"{r.layout:27s}{min(r.agreement):>10.4f}{per_step:>26s}{r.mean_mismatch:>9.5f}"
            f"{ratio:>7.3f}{r.mean_step_s:>8.2f}{r.mean_step_s / ref.mean_step_s:>7.2f}"
            f"{r.mean_train_s:>8.2f}{r.mean_train_s / ref.mean_train_s:>7.2f}"
            f"{r.seconds:>7.0f}" + ("" if ok else "  MISSED")
        )
    print(f"target: agreement 1.0 and mismatch <= {MAX_RATIO}x the model's one rank's")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
