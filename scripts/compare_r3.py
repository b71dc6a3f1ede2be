"""R3 on vs off (and GSPO without R3) over several seeds: learning and mismatch.

    python scripts/compare_r3.py [--seeds 3] [--steps N] [--arms r3,no_r3,gspo]
                                 [--png compare_r3.png] [--json] [--histories FILE]
                                 [--resume | --replot] [--bar 0.5 --max-drop 0.1]
                                 [--strategy megatron|fsdp] [--jobs N] [hydra overrides ...]

Each arm runs the embedded default (plus the overrides) once per seed
(``trainer.seed`` = 0, 1, ...: prompts and sampling change, the model does not); every
arm returns routes from the server, so the mismatch metrics compare like with like.

- ``r3``: routing replay on (the default);
- ``no_r3``: replay off, same PPO loss;
- ``gspo``: replay off with GSPO's sequence-level ratio (clip 3e-4 / 4e-4), the
  method designed to stay stable on MoE models without replay.

Printed per arm, mean ± standard deviation over seeds (and the min..max spread): the
final train reward (mean of the last five steps), the final greedy eval reward and
success rate, and the rollout-vs-trainer mismatch averaged over steps. The PNG plots
each arm's train reward and eval success per step (mean over seeds, min..max shaded).
Then each seed's final and best greedy eval reward, checked against ``--bar`` (the
final value) and ``--max-drop`` (final below the seed's own best); the exit status is
1 when a seed fails, so ``--seeds 10 --arms r3 --bar 0.8`` is the default recipe's
robustness check. ``--jobs 3`` runs three at a time, each in its own process: the
results are the same, a run's wall time is not (time one alone).
``--strategy`` picks the trainer backend (``trainer.strategy``; the config's by default),
so ``--seeds 5 --strategy fsdp`` is the same check on the FSDP backend.
``--histories`` keeps every run's metrics as it finishes; ``--resume`` reruns only
the runs it lacks (a crash, or code edited under a running comparison, costs one run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import os
import platform
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_train.config.compose import load_config  # noqa: E402
from skyrl_train.config.schema import STRATEGIES  # noqa: E402
from skyrl_train.entrypoints.main_base import run  # noqa: E402
from skyrl_train.utils.cpu_topology import cpu_model  # noqa: E402

REPLAY_KEY = "trainer.policy.routing_replay.enabled"
ALG = "trainer.algorithm"
ARMS: dict[str, tuple[str, list[str]]] = {
    "r3": ("R3 on", [f"{REPLAY_KEY}=true"]),
    "no_r3": ("R3 off", [f"{REPLAY_KEY}=false"]),
    # Issue 52's learning target: the same recipe trained on packed microbatches.
    "r3_packed": (
        "R3 on, packed",
        [f"{REPLAY_KEY}=true", "trainer.remove_microbatch_padding=true"],
    ),
    "gspo": (
        "GSPO, R3 off",
        [
            f"{REPLAY_KEY}=false",
            f"{ALG}.policy_loss_type=gspo",
            f"{ALG}.eps_clip_low=0.0003",
            f"{ALG}.eps_clip_high=0.0004",
        ],
    ),
}
# (name in the summary, metric key, label, how a run's history reduces to one number);
# names are unique: one metric may be reduced twice (final and best eval).
MT = "mismatch_trained/"
ROWS = tuple(
    (name or key, key, label, how)
    for key, label, how, name in (
        ("reward/mean", "train reward, last 5 steps", "last5", None),
        ("eval/reward_mean", "eval reward (greedy), final", "last", None),
        ("eval/reward_mean", "eval reward (greedy), best", "max", "eval/reward_mean_best"),
        ("eval/success_rate", "eval success (greedy), final", "last", None),
        ("reward/success_rate", "train success, last 5 steps", "last5", None),
        ("r3/router_agreement_trained", "router agreement (training forward)", "mean", None),
        (MT + "mean_abs_logp_diff", "mean |Δlogp|", "mean", None),
        (MT + "max_abs_logp_diff", "max |Δlogp|", "max", None),
        (MT + "k3_kl", "k3 KL(rollout||trainer)", "mean", None),
        (MT + "frac_abs_logp_diff_gt_ln2", "share |Δlogp| > ln 2", "mean", None),
        ("policy/entropy", "policy entropy, last step", "last", None),
        ("timing/train_s", "train time per step [s]", "mean", None),
    )
)


def reduce_history(history: list[dict[str, float]]) -> dict[str, float]:
    """One number per row of one run (``ROWS``' reductions, by row name); absent metrics
    skipped."""
    out: dict[str, float] = {}
    for name, key, _label, how in ROWS:
        values = [h[key] for h in history if h.get(key) is not None]
        if not values:
            continue
        reduce = {
            "mean": np.mean,
            "max": np.max,
            "last": lambda v: v[-1],
            "last5": lambda v: np.mean(v[-5:]),
        }[how]
        out[name] = float(reduce(values))
    return out


@dataclasses.dataclass(frozen=True)
class SeedResult:
    """One run's greedy eval: where it ended against its own best."""

    seed: int
    final: float
    best: float
    best_step: int

    @property
    def drop(self) -> float:
        return self.best - self.final

    def passes(self, *, bar: float, max_drop: float) -> bool:
        return self.final >= bar and self.drop <= max_drop


def seed_results(histories: list[list[dict[str, float]]]) -> list[SeedResult]:
    """Per seed (the histories' order: ``trainer.seed`` 0, 1, ...), the final and best
    ``eval/reward_mean``; a run that never evaluated is an error, not a pass."""
    out = []
    for seed, history in enumerate(histories):
        evals = [
            (i + 1, h["eval/reward_mean"]) for i, h in enumerate(history) if "eval/reward_mean" in h
        ]
        if not evals:
            raise ValueError(f"seed {seed}: expected eval/reward_mean in its history, got none")
        best_step, best = max(evals, key=lambda e: e[1])
        out.append(SeedResult(seed, evals[-1][1], best, best_step))
    return out


def spread(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(arr.mean()),
        "std": float(arr.std(ddof=1)) if arr.size > 1 else 0.0,
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


def curve(histories: list[list[dict[str, float]]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps at which every seed logged ``key`` and the values ``[seeds, steps]``; a
    history's entry i is step i + 1 (``run`` starts at step 0)."""
    logged = [{i + 1: h[key] for i, h in enumerate(hist) if key in h} for hist in histories]
    steps = sorted(set.intersection(*(set(d) for d in logged)))
    return np.asarray(steps), np.array([[d[s] for s in steps] for d in logged])


def plot(results: dict[str, list[list[dict[str, float]]]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("reward/mean", "train reward"), ("eval/success_rate", "eval success (greedy)"))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(16, 4))
    for ax, (key, label) in zip(axes[: len(panels)], panels, strict=True):
        for arm, histories in results.items():
            steps, values = curve(histories, key)
            if steps.size == 0:
                continue
            line = ax.plot(steps, values.mean(axis=0), label=ARMS[arm][0])[0]
            ax.fill_between(
                steps, values.min(axis=0), values.max(axis=0), color=line.get_color(), alpha=0.2
            )
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    # Every seed's own eval curve: a mean hides the one seed that collapses late.
    ax = axes[-1]
    for arm, histories in results.items():
        color = None
        for seed, history in enumerate(histories):
            steps, values = curve([history], "eval/reward_mean")
            if steps.size == 0:
                continue
            label = ARMS[arm][0] if seed == 0 else None
            line = ax.plot(steps, values[0], color=color, alpha=0.7, lw=1, label=label)[0]
            color = line.get_color()
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_title("eval reward (greedy), each seed")
    ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def run_one(arm: str, seed: int, overrides: list[str], run_dir: str) -> list[dict[str, float]]:
    """One run of ``arm`` on ``seed``: its per-step metrics."""
    cfg = load_config(
        [
            "logging.progress_bar=false",
            "logging.plot=false",
            f"trainer.run_dir={run_dir}",
            f"trainer.seed={seed}",
            *ARMS[arm][1],
            *overrides,
        ]
    )
    return run(cfg)


class SeedOrder:
    """Runs as they finish, in any order, kept per arm as seeds 0, 1, ... with no gap:
    the histories file (and ``--resume``) only ever holds a run whose seeds below it
    are there too."""

    def __init__(self, arms: list[str], done: dict[str, list[list[dict[str, float]]]]):
        self.histories = {arm: list(done.get(arm, [])) for arm in arms}
        self._early: dict[tuple[str, int], list[dict[str, float]]] = {}

    def missing(self, seeds: int) -> list[tuple[int, str]]:
        """(seed, arm) not yet run, seed by seed, arms alternating within a seed."""
        return [
            (seed, arm)
            for seed in range(seeds)
            for arm in self.histories
            if seed >= len(self.histories[arm])
        ]

    def add(self, arm: str, seed: int, history: list[dict[str, float]]) -> None:
        self._early[(arm, seed)] = history
        runs = self.histories[arm]
        while (arm, len(runs)) in self._early:
            runs.append(self._early.pop((arm, len(runs))))


def run_arms(
    arms: list[str],
    seeds: int,
    overrides: list[str],
    out: Path | None,
    *,
    done: dict[str, list[list[dict[str, float]]]] | None = None,
    jobs: int = 1,
) -> dict[str, list[list[dict[str, float]]]]:
    """Every arm once per seed, arms alternating within a seed (drift hits all alike),
    ``jobs`` runs at a time (each its own process and local Ray); the histories are
    written to ``out`` after each run, so a crash loses nothing, and runs already in
    ``done`` (seeds 0..n-1 of an arm) are kept, not rerun."""
    order = SeedOrder(arms, done or {})

    def finished(arm: str, seed: int, history: list[dict[str, float]]) -> None:
        order.add(arm, seed, history)
        if out is not None:
            out.write_text(json.dumps(order.histories))
        print(f"done: {arm} seed {seed}: {reduce_history(history)}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        todo = [
            (arm, seed, overrides, str(Path(tmp) / f"{arm}_{seed}"))
            for seed, arm in order.missing(seeds)
        ]
        if jobs == 1:
            for args in todo:
                finished(args[0], args[1], run_one(*args))
        else:
            # Spawned, not forked: each run starts its own Ray and threads.
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
                futures = {pool.submit(run_one, *args): args for args in todo}
                for future in as_completed(futures):
                    arm, seed = futures[future][:2]
                    finished(arm, seed, future.result())
    return order.histories


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="default: the config's")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--png", type=Path, default=Path("compare_r3.png"))
    parser.add_argument("--json", action="store_true")
    add = parser.add_argument
    add("--jobs", type=int, default=1, help="runs at a time, each its own process")
    add("--histories", type=Path, default=None, help="every run's metrics (JSON) here")
    add("--replot", action="store_true", help="summarise --histories, no runs")
    add("--bar", type=float, default=0.5, help="per seed: final greedy eval at least this")
    add("--max-drop", type=float, default=0.1, help="per seed: final at most this below best")
    add("--strategy", choices=STRATEGIES, default=None, help="trainer.strategy; default: config's")
    add("--resume", action="store_true", help="keep --histories' runs (same overrides)")
    args, overrides = parser.parse_known_args()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown or args.seeds < 1:
        parser.error(f"--arms: expected names from {list(ARMS)}, got {unknown}; --seeds >= 1")
    if args.jobs < 1:
        parser.error(f"--jobs: expected at least 1, got {args.jobs}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The launch logs each step through ``logging`` (the CLI sets up its console itself).
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    steps = [f"trainer.num_steps={args.steps}"] if args.steps else []
    if args.strategy is not None:
        # In the overrides, so the title, the JSON and a --resume all name the backend.
        overrides = [f"trainer.strategy={args.strategy}", *overrides]
    if args.replot:
        if args.histories is None:
            parser.error("--replot: expected --histories FILE")
        histories = json.loads(args.histories.read_text())
        arms = list(histories)
    else:
        done = None
        if args.resume:
            if args.histories is None or not args.histories.is_file():
                parser.error("--resume: expected an existing --histories FILE")
            done = json.loads(args.histories.read_text())
        histories = run_arms(
            arms, args.seeds, [*steps, *overrides], args.histories, done=done, jobs=args.jobs
        )
    reduced = {arm: [reduce_history(h) for h in hists] for arm, hists in histories.items()}
    summary = {
        arm: {
            key: spread([r[key] for r in runs])
            for key, _metric, _label, _how in ROWS
            if all(key in r for r in runs)
        }
        for arm, runs in reduced.items()
    }
    title = (
        f"{len(histories[arms[0]])} seeds x {len(histories[arms[0]][0])} steps, overrides: "
        f"{overrides or 'none'}; {cpu_model()}"
    )
    plot(histories, args.png, title)
    if args.json:
        per_seed = {
            arm: [dataclasses.asdict(r) for r in seed_results(runs)]
            for arm, runs in histories.items()
        }
        print(json.dumps({"overrides": overrides, **summary, "per_seed": per_seed}, indent=2))
        return
    print(f"python {platform.python_version()}, {cpu_model()}, {os.cpu_count()} cpus")
    print(title)
    print(f"{'metric (mean ± std over seeds [min..max])':44s}", end="")
    print("".join(f"{ARMS[a][0]:>36s}" for a in arms))
    for key, _metric, label, _how in ROWS:
        cells = []
        for arm in arms:
            s = summary[arm].get(key)
            cells.append(
                "n/a"
                if s is None
                else f"{s['mean']:.4g} ± {s['std']:.2g} [{s['min']:.3g}..{s['max']:.3g}]"
            )
        print(f"{label:44s}" + "".join(f"{c:>36s}" for c in cells))
    failed = print_seed_table(histories, bar=args.bar, max_drop=args.max_drop)
    print(f"curves: {args.png}")
    if failed:
        sys.exit(1)


def print_seed_table(
    histories: dict[str, list[list[dict[str, float]]]], *, bar: float, max_drop: float
) -> int:
    """Each arm's seeds, final and best eval, against the bar; returns the failures."""
    failed = 0
    print(f"\nper seed (greedy eval reward; pass: final >= {bar} and best - final <= {max_drop})")
    for arm, runs in histories.items():
        for r in seed_results(runs):
            ok = r.passes(bar=bar, max_drop=max_drop)
            failed += not ok
            print(
                f"  {ARMS[arm][0]:14s} seed {r.seed}: final {r.final:.3f}, best {r.best:.3f} "
                f"(step {r.best_step}), drop {r.drop:.3f}  {'pass' if ok else 'FAIL'}"
            )
    return failed


if __name__ == "__main__":
    main()
