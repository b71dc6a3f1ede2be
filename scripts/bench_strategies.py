"""Step time of the two trainer backends on the default run, side by side in one process
(issue 40's target; docs/backends.md).

    OMP_NUM_THREADS=1 python scripts/bench_strategies.py [--steps 20] [--rounds 2] [overrides ...]

Each round launches the embedded default (``configs/ppo_base_config.yaml``) plus the
overrides once per ``trainer.strategy`` (megatron, then fsdp, alternating between
rounds so drift on a shared machine hits both alike), seed 0, R3, for ``--steps``
steps without evaluation. The first step of each run (warm-up: first allocations,
lazy imports) is left out. Printed per backend: the median over the kept steps of the
trainer's time per step (``timing/train_s``: old log-probs, the updates and the
metrics forwards), of the whole step (``timing/step_s``), and the launch's wall time,
with the FSDP / Megatron ratio of each, and the CPU model.

Both backends see the same prompts and the same first rollouts; later batches differ
by each backend's rounding (about 1e-6 in the log-probs), as between any two layouts.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_train.config.compose import load_config  # noqa: E402
from skyrl_train.config.schema import STRATEGIES  # noqa: E402
from skyrl_train.entrypoints.main_base import run  # noqa: E402
from skyrl_train.utils.cpu_topology import cpu_model  # noqa: E402

KEYS = {"train": "timing/train_s", "step": "timing/step_s"}


def launch(strategy: str, *, steps: int, overrides: list[str], run_dir: Path) -> dict[str, list]:
    cfg = load_config(
        [
            *overrides,
            f"trainer.strategy={strategy}",
            f"trainer.num_steps={steps}",
            "trainer.seed=0",
            "trainer.eval_interval=0",
            "trainer.hf_save_interval=-1",
            "logging.plot=false",
            "logging.progress_bar=false",
            f"trainer.run_dir={run_dir}",
        ]
    )
    start = time.perf_counter()
    history = run(cfg)
    wall = time.perf_counter() - start
    kept = history[1:]  # the first step pays for first allocations and lazy imports
    return {
        **{name: [m[key] for m in kept if key in m] for name, key in KEYS.items()},
        "wall": [wall],
        "agreement": [m["r3/router_agreement_trained"] for m in history],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args, overrides = parser.parse_known_args()
    if args.steps < 2 or args.rounds < 1:
        parser.error(f"--steps: expected >= 2, got {args.steps}; --rounds: expected >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, dict[str, list]] = {
        s: {"train": [], "step": [], "wall": [], "agreement": []} for s in STRATEGIES
    }
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = STRATEGIES if round_ % 2 == 0 else tuple(reversed(STRATEGIES))
            for strategy in order:
                got = launch(
                    strategy,
                    steps=args.steps,
                    overrides=overrides,
                    run_dir=Path(tmp) / f"{strategy}_{round_}",
                )
                for key, values in got.items():
                    results[strategy][key].extend(values)
    print(f"{cpu_model()}, {os.cpu_count()} cpus; torch threads per process: 1 (OMP_NUM_THREADS)")
    print(
        f"default run, seed 0, R3, {args.steps} steps x {args.rounds} rounds per backend "
        f"(first step of each run left out); overrides: {overrides or 'none'}"
    )
    print(f"{'':24s}{'megatron':>10s}{'fsdp':>10s}{'fsdp / megatron':>18s}")
    rows = (
        ("trainer s/step (median)", "train"),
        ("whole step s (median)", "step"),
        ("launch wall s (median)", "wall"),
    )
    for label, key in rows:
        meg, fsdp = (statistics.median(results[s][key]) for s in STRATEGIES)
        print(f"{label:24s}{meg:>10.3f}{fsdp:>10.3f}{fsdp / meg:>18.2f}")
    low = {s: min(results[s]["agreement"]) for s in STRATEGIES}
    print(f"router agreement (min over steps): {low}")


if __name__ == "__main__":
    main()
