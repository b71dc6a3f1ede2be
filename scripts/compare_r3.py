"""Run the embedded default twice, routing replay on and off, and compare R3 figures.

    python scripts/compare_r3.py [--steps N] [--json] [hydra overrides ...]

Both runs use the same seeds and return routes from the server; only
``trainer.policy.megatron_config.moe_enable_routing_replay`` differs. Printed side
by side: router agreement of the training forward with the rollout, the
rollout-vs-trainer logprob mismatch (mean and max |Δlogp|, k3 KL, share of tokens with
|Δlogp| > ln 2), averaged over steps, and the last step's reward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_train.config.loader import load_config  # noqa: E402
from skyrl_train.entrypoints.main_base import run  # noqa: E402

REPLAY_KEY = "trainer.policy.megatron_config.moe_enable_routing_replay"
ROWS = (
    ("r3/router_agreement_trained", "router agreement (training forward)", "mean"),
    ("mismatch_trained/mean_abs_logp_diff", "mean |Δlogp|", "mean"),
    ("mismatch_trained/max_abs_logp_diff", "max |Δlogp|", "max"),
    ("mismatch_trained/k3_kl", "k3 KL(rollout||trainer)", "mean"),
    ("mismatch_trained/frac_abs_logp_diff_gt_ln2", "share |Δlogp| > ln 2", "mean"),
    ("reward/mean", "reward, last step", "last"),
    ("timing/train_s", "train time per step [s]", "mean"),
)


def summarise(history: list[dict[str, float]]) -> dict[str, float]:
    out = {}
    for key, _label, how in ROWS:
        values = [h[key] for h in history if h.get(key) is not None]
        if not values:
            continue
        out[key] = {"mean": float(np.mean(values)), "max": float(np.max(values))}.get(
            how, float(values[-1])
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args, overrides = parser.parse_known_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, replay in (("on", True), ("off", False)):
            cfg = load_config(
                [
                    f"trainer.num_steps={args.steps}",
                    "trainer.eval_interval=0",
                    "logging.progress_bar=false",
                    "logging.plot=false",
                    f"trainer.run_dir={Path(tmp) / name}",
                    f"{REPLAY_KEY}={str(replay).lower()}",
                    *overrides,
                ]
            )
            results[name] = summarise(run(cfg))
    if args.json:
        print(json.dumps({"steps": args.steps, "overrides": overrides, **results}, indent=2))
        return
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cpus")
    print(f"{args.steps} steps per run, overrides: {overrides or 'none'}")
    print(f"{'metric':40s} {'R3 on':>12s} {'R3 off':>12s} {'off/on':>8s}")
    for key, label, _how in ROWS:
        on, off = results["on"].get(key), results["off"].get(key)
        if on is None or off is None:
            continue
        ratio = f"{off / on:8.2f}" if on else "     n/a"
        print(f"{label:40s} {on:12.6g} {off:12.6g} {ratio}")


if __name__ == "__main__":
    main()
