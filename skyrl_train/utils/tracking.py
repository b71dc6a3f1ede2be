"""Per-step metrics to the trackers in ``logging.trackers``, a PNG at the end.

Each tracker is one small class with the same two calls (``Tracker``): ``jsonl``
(always available, the file the plot and the tests read), and ``tensorboard``,
``wandb`` and ``mlflow``, each an optional extra (``pip install 'skyrl-r3[wandb]'``).
``check_trackers`` refuses an unknown, repeated or not-installed name when the config
is validated, so asking for a tracker never silently logs nothing.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import orjson

from skyrl_train.errors import ConfigValidationError
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


class Tracker(Protocol):
    """One metrics destination, built as ``cls(run_dir, start_step=n)``.

    ``log`` gets every metric of a step, a value that is not finite as None (JSONL
    writes it as null; the others leave it out). ``requires`` is the module the tracker
    imports (None: nothing beyond the default install); its pip extra has the
    tracker's name.
    """

    requires: ClassVar[str | None]

    def __init__(self, run_dir: Path, *, start_step: int) -> None: ...

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None: ...

    def close(self) -> None: ...


class JsonlTracker:
    """``{"step": n, **metrics}`` appended to ``<run_dir>/metrics.jsonl``.

    A run starting after ``start_step`` (0 for a fresh run, the checkpoint's step for
    a resumed one) owns every later step: lines of steps > ``start_step`` that an
    earlier run left in the folder are dropped first (``drop_steps_after``, an atomic
    rewrite), so a run resumed into its own folder holds each step exactly once.
    """

    requires: ClassVar[str | None] = None

    def __init__(self, run_dir: Path, *, start_step: int) -> None:
        self.path = run_dir / "metrics.jsonl"
        drop_steps_after(self.path, start_step)

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        with self.path.open("ab") as fh:
            fh.write(orjson.dumps({"step": step, **metrics}) + b"\n")

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """Event files in ``<run_dir>/tensorboard``; TensorBoard is told to purge the
    events of steps from ``start_step + 1`` on, which a resumed run logs again."""

    requires: ClassVar[str | None] = "torch.utils.tensorboard"

    def __init__(self, run_dir: Path, *, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        for key, value in _present(metrics).items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run named after ``run_dir``, its files under ``run_dir``.

    Everything else is wandb's own settings, read from its environment variables:
    ``WANDB_PROJECT`` (the project), ``WANDB_MODE`` (``offline`` on a machine without
    network, ``disabled``), ``WANDB_API_KEY``. A resumed launch is a new wandb run
    starting at ``start_step + 1``.
    """

    requires: ClassVar[str | None] = "wandb"

    def __init__(self, run_dir: Path, *, start_step: int) -> None:
        import wandb

        self._run = wandb.init(name=run_dir.name, dir=str(run_dir))

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        self._run.log(_present(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run named after ``run_dir``.

    Where it goes is MLflow's own settings, read from its environment variables:
    ``MLFLOW_TRACKING_URI`` (unset: a local store in the working folder, no network)
    and ``MLFLOW_EXPERIMENT_NAME``. A resumed launch is a new MLflow run.
    """

    requires: ClassVar[str | None] = "mlflow"

    def __init__(self, run_dir: Path, *, start_step: int) -> None:
        import mlflow

        self._mlflow = mlflow
        mlflow.start_run(run_name=run_dir.name)

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        self._mlflow.log_metrics(_present(metrics), step=step)

    def close(self) -> None:
        self._mlflow.end_run()


TRACKERS: dict[str, type[Tracker]] = {
    "jsonl": JsonlTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}
"""The ``logging.trackers`` choices."""


def check_trackers(trackers: Sequence[str]) -> None:
    """Refuse an unknown, repeated or not-installed tracker in ``logging.trackers``.

    "Installed" means the tracker's module imports: the check runs at validation,
    before Ray starts, instead of the first step finding out.
    """
    first_at: dict[str, int] = {}
    for i, name in enumerate(trackers):
        key = f"logging.trackers[{i}]"
        if name not in TRACKERS:
            raise ConfigValidationError(
                key, expected=f"one of {', '.join(TRACKERS)}", got=repr(name)
            )
        if name in first_at:
            raise ConfigValidationError(
                key,
                expected="each tracker once",
                got=f"{name!r} again (also logging.trackers[{first_at[name]}])",
            )
        first_at[name] = i
        module = TRACKERS[name].requires
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigValidationError(
                key,
                expected=f"an installed tracker (pip install 'skyrl-r3[{name}]')",
                got=f"{name!r} ({exc})",
            ) from exc


class MetricsTracker:
    """Every step's metrics to each tracker named in ``trackers`` (``TRACKERS``).

    ``start_step`` is the step the run starts after (0 for a fresh run, the
    checkpoint's step for a resumed one); each tracker drops or purges what an
    earlier run logged after it.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        trackers: Sequence[str] = ("jsonl",),
        start_step: int = 0,
    ) -> None:
        check_trackers(trackers)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._trackers: list[Tracker] = []
        try:
            for name in trackers:
                self._trackers.append(TRACKERS[name](self.run_dir, start_step=start_step))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: _finite_or_none(v) for k, v in metrics.items()}
        for tracker in self._trackers:
            tracker.log(step, clean)

    def close(self) -> None:
        """Close every tracker, even after one fails; then raise the first failure."""
        trackers, self._trackers = self._trackers, []
        failure: Exception | None = None
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure


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


def _present(metrics: Mapping[str, float | None]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if v is not None}


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
