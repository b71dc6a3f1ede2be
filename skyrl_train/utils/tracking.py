"""Per-step metrics: one JSONL line each, TensorBoard when installed, a PNG at the end."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from skyrl_train.utils.durable import replace_file

# One panel each in the end-of-run plot: what the run learns (reward, success, the
# learning signals), then the figures other R3 systems publish.
PLOT_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", (("reward/mean", "train"), ("eval/reward_mean", "eval (greedy)"))),
    (
        "success rate (solved episodes)",
        (("reward/success_rate", "train"), ("eval/success_rate", "eval (greedy)")),
    ),
    ("policy entropy (nats/token)", (("policy/entropy", "response tokens"),)),
    ("KL to the initial policy (k3, nats/token)", (("policy/kl_to_ref", "policy vs reference"),)),
    (
        "flat groups and clipped tokens (share)",
        (
            ("advantage/zero_variance_group_frac", "groups with equal rewards"),
            ("policy/clip_fraction", "clipped tokens"),
        ),
    ),
    (
        "router agreement with the rollout",
        (
            ("r3/router_agreement_trained", "as trained (replay when on)"),
            ("r3/router_agreement_native", "trainer's own routing"),
        ),
    ),
    (
        "|Δlogp| rollout vs trainer",
        (
            ("mismatch_trained/mean_abs_logp_diff", "mean, as trained"),
            ("mismatch_trained/max_abs_logp_diff", "max, as trained"),
            ("mismatch_native/mean_abs_logp_diff", "mean, no replay"),
            ("mismatch_native/max_abs_logp_diff", "max, no replay"),
        ),
    ),
)


class MetricsTracker:
    """Appends ``{"step": n, **metrics}`` to ``<run_dir>/metrics.jsonl`` (when ``jsonl``).

    A run starting after ``start_step`` (0 for a fresh run, the checkpoint's step for a
    resumed one) owns every later step: lines of steps > ``start_step`` that an earlier
    run left in the folder are dropped first (``drop_steps_after``, an atomic rewrite),
    so a run resumed into its own folder holds each step exactly once, and TensorBoard
    is told to purge its events from ``start_step + 1`` on.

    TensorBoard logging is optional: it is used when ``tensorboard`` imports, and
    silently skipped otherwise, because the default install must stay small.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        jsonl: bool = True,
        tensorboard: bool = True,
        start_step: int = 0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.jsonl = jsonl
        if jsonl:
            drop_steps_after(self.path, start_step)
        self._writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._writer = None
            else:
                self._writer = SummaryWriter(
                    str(self.run_dir / "tensorboard"), purge_step=start_step + 1
                )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: _finite_or_none(v) for k, v in metrics.items()}
        if self.jsonl:
            with self.path.open("ab") as fh:
                fh.write(orjson.dumps({"step": step, **clean}) + b"\n")
        if self._writer is not None:
            for key, value in clean.items():
                if value is not None:
                    self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def drop_steps_after(path: str | Path, step: int) -> int:
    """Keep only the lines of ``path`` with a step <= ``step``; returns how many went.

    The file is rewritten beside itself, fsynced and renamed over the original, so a
    crash leaves the old file or the new one. A line that does not parse (the torn
    last line of a killed run) is dropped with the rest.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            line_step = orjson.loads(line)["step"]
            keep = isinstance(line_step, int) and line_step <= step
        except (orjson.JSONDecodeError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line + b"\n")
        else:
            dropped += 1
    if dropped:
        replace_file(path, b"".join(kept))
    return dropped


def _finite_or_none(value: Any) -> float | None:
    # orjson refuses NaN/inf; a metric that could not be computed becomes null.
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    lines = Path(path).read_bytes().splitlines()
    return [orjson.loads(line) for line in lines if line.strip()]


def format_metrics_line(
    step: int, metrics: Mapping[str, float], keys: tuple[tuple[str, str], ...]
) -> str:
    """``step 3 reward=0.41 ...``: the given (key, label) pairs that are present."""
    parts = [f"step {step}"]
    for key, label in keys:
        value = metrics.get(key)
        if value is not None:
            parts.append(f"{label}={value:.4g}")
    return " ".join(parts)


PLOT_COLUMNS = 3


def plot_metrics(path: str | Path, out_png: str | Path) -> Path:
    """``PLOT_PANELS`` per step (reward, success, entropy, flat groups and clipping,
    router agreement, logprob mismatch), ``PLOT_COLUMNS`` panels a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    steps = [row["step"] for row in rows]
    rows_of_panels = -(-len(PLOT_PANELS) // PLOT_COLUMNS)
    fig, grid = plt.subplots(
        rows_of_panels, PLOT_COLUMNS, figsize=(5 * PLOT_COLUMNS, 4 * rows_of_panels), squeeze=False
    )
    axes = list(grid.flat)
    for ax in axes[len(PLOT_PANELS) :]:
        ax.set_visible(False)
    for ax, (title, series) in zip(axes, PLOT_PANELS, strict=False):
        for key, label in series:
            points = [
                (s, row[key])
                for s, row in zip(steps, rows, strict=True)
                if row.get(key) is not None
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
