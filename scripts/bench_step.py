"""Sync vs fully async training steps on the same config, in one run.

    python scripts/bench_step.py [--seeds 3] [--steps 40] [--warmup 5] [--json]
                                 [--histories FILE] [hydra overrides ...]

Each seed runs the embedded default (plus the overrides) twice, sync then async
(``trainer.fully_async.enabled``, ``max_staleness_steps`` 1), the order alternating
from seed to seed so machine drift hits both alike. Both arms use TIS against the
rollout logprobs (async needs it), so overlap is the only difference. Evaluation is
off: it would time the same greedy rollouts in both arms.

Printed per arm: steady-state seconds per step (the median ``timing/step_s`` after
the first ``--warmup`` steps; the median resists a step that waited for a slow
checkpoint write or a noisy neighbour), the train reward averaged over the last ten
steps, and for async the staleness seen. Then async / sync for the step time, and
whether each seed's async reward lies within the sync runs' spread.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_train.config.compose import load_config  # noqa: E402
from skyrl_train.entrypoints.main_base import run  # noqa: E402
from skyrl_train.utils.cpu_topology import cpu_model  # noqa: E402

ARMS = {
    "sync": ["trainer.fully_async.enabled=false"],
    "async": ["trainer.fully_async.enabled=true", "trainer.fully_async.max_staleness_steps=1"],
}
COMMON = [
    "trainer.algorithm.use_tis=true",
    "trainer.eval_interval=0",
    "logging.progress_bar=false",
    "logging.plot=false",
]


def summarise(history: list[dict[str, float]], warmup: int) -> dict[str, float]:
    steady = [row["timing/step_s"] for row in history[warmup:]] or [np.nan]
    rewards = [row["reward/mean"] for row in history]
    out = {
        "step_s": float(np.median(steady)),
        "reward_last10": float(np.mean(rewards[-10:])),
        "reward_mean": float(np.mean(rewards)),
    }
    stale = [row.get("async/staleness_max", 0.0) for row in history]
    out["staleness_max"] = float(max(stale))
    out["staleness_mean"] = float(
        np.mean([row.get("async/staleness_mean", 0.0) for row in history])
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--histories", type=Path, default=None, help="write every run here")
    args, overrides = parser.parse_known_args()
    if args.seeds < 1 or args.steps <= args.warmup:
        parser.error(f"expected --seeds >= 1 and --steps > --warmup, got {args}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    histories: dict[str, list[list[dict[str, float]]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            order = list(ARMS) if seed % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                cfg = load_config(
                    [
                        *COMMON,
                        *ARMS[arm],
                        f"trainer.num_steps={args.steps}",
                        f"trainer.seed={seed}",
                        f"trainer.run_dir={Path(tmp) / f'{arm}_{seed}'}",
                        *overrides,
                    ]
                )
                history = run(cfg)
                histories[arm].append(history)
                runs[arm].append(summarise(history, args.warmup))
                if args.histories is not None:
                    args.histories.write_text(json.dumps(histories))

    sync_step = float(np.median([r["step_s"] for r in runs["sync"]]))
    async_step = float(np.median([r["step_s"] for r in runs["async"]]))
    sync_rewards = [r["reward_last10"] for r in runs["sync"]]
    low, high = min(sync_rewards), max(sync_rewards)
    result = {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "steps": args.steps,
        "warmup": args.warmup,
        "seeds": args.seeds,
        "overrides": overrides,
        "runs": runs,
        "sync_step_s": sync_step,
        "async_step_s": async_step,
        "async_over_sync": async_step / sync_step,
        "sync_reward_last10_range": [low, high],
        "async_rewards_within_sync_range": [
            low <= r["reward_last10"] <= high for r in runs["async"]
        ],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{cpu_model()}, {os.cpu_count()} cpus, python {platform.python_version()}")
    print(f"{args.seeds} seeds x {args.steps} steps, timing after step {args.warmup}")
    for arm in ARMS:
        for seed, r in enumerate(runs[arm]):
            print(
                f"  {arm:5s} seed {seed}: {r['step_s']:.3f} s/step, reward last 10 "
                f"{r['reward_last10']:.3f}, staleness max {r['staleness_max']:.0f} "
                f"mean {r['staleness_mean']:.2f}"
            )
    print(f"sync  {sync_step:.3f} s/step (median over seeds)")
    print(f"async {async_step:.3f} s/step")
    print(f"async / sync: {async_step / sync_step:.2f} (target <= 0.65)")
    print(
        f"async reward last 10 within sync's [{low:.3f}, {high:.3f}]: "
        f"{result['async_rewards_within_sync_range']}"
    )


if __name__ == "__main__":
    main()
