"""Reading run folders for the viewer: what is plotted, what is listed, what is wrong.

Nothing here raises on a damaged file except ``check_run_folder`` (a folder that is
not a run at all): a torn metrics line or dump becomes a warning naming the file, and
the page shows the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from skyrl_train.errors import SkyRLTrainError
from skyrl_train.runs.rollouts import ROLLOUTS_DIR, DumpRef, RolloutDumpError, list_dumps
from skyrl_train.utils.tracking import PLOT_PANELS

# runs.folder.MARKER_FILE; not imported, since runs.folder loads torch (seconds) and the
# viewer needs none of it (tests/skyrl_train/viewer/test_inputs.py checks they agree).
RUN_MARKER = "run.json"
METRICS_FILE = "metrics.jsonl"

PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    *PLOT_PANELS,
    (
        "time per step (s)",
        (("timing/step_s", "step"), ("timing/generate_s", "generate"), ("timing/train_s", "train")),
    ),
)
"""The metrics plots: the end-of-run plot's panels and the step timings; only these
keys reach the page."""


class NotARunError(SkyRLTrainError, ValueError):
    """A path given as a run folder that holds none of a run's files."""


@dataclass
class RunInput:
    """One run folder as the page shows it."""

    path: Path
    name: str
    metrics: list[dict[str, Any]]
    dumps: list[DumpRef]
    warnings: list[str] = field(default_factory=list)


def check_run_folder(path: Path) -> None:
    """Refuse a path that is not a run folder, saying what is there instead."""
    expected = f"{path}: expected a run folder ({RUN_MARKER}, {METRICS_FILE} or {ROLLOUTS_DIR}/)"
    if not path.exists():
        raise NotARunError(f"{expected}, got no such file or folder")
    if not path.is_dir():
        raise NotARunError(f"{expected}, got a file")
    if not any((path / name).exists() for name in (RUN_MARKER, METRICS_FILE, ROLLOUTS_DIR)):
        entries = sorted(p.name for p in path.iterdir())
        shown = ", ".join(entries[:5]) + (
            f" and {len(entries) - 5} more" if len(entries) > 5 else ""
        )
        raise NotARunError(f"{expected}, got a folder holding {shown or 'nothing'}")


def read_metrics_tolerant(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a ``metrics.jsonl`` by step (the last row of a repeated step wins),
    and a warning for each line that could not be read (a torn last line is what a
    killed run leaves)."""
    if not path.exists():
        return [], []
    lines = path.read_bytes().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: dict[int, dict[str, Any]] = {}
    warnings = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            what = "a torn last line" if i == last else "a line that is not JSON"
            warnings.append(f"{path}:{i + 1}: skipped {what}")
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            warnings.append(f"{path}:{i + 1}: skipped a line without an integer 'step'")
            continue
        rows[step] = row
    return [rows[step] for step in sorted(rows)], warnings


def plotted_series(rows: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """``{key: [steps, values]}`` for the plotted keys with any finite value."""
    series: dict[str, list[list[float]]] = {}
    for _title, keys in PANELS:
        for key, _label in keys:
            points = [
                (row["step"], float(row[key]))
                for row in rows
                if isinstance(row.get(key), int | float)
                and not isinstance(row.get(key), bool)
                and math.isfinite(row[key])
            ]
            if points:
                series[key] = [[p[0] for p in points], [p[1] for p in points]]
    return series


def unique_names(paths: list[Path]) -> list[str]:
    """Each run's folder name; a repeated one gets its parent folder's name too."""
    names = [p.name or str(p) for p in paths]
    out = []
    for path, name in zip(paths, names, strict=True):
        if names.count(name) > 1:
            name = f"{path.parent.name}/{name}"
        while name in out:
            name += "'"
        out.append(name)
    return out


def load_runs(paths: list[Path]) -> list[RunInput]:
    """The runs to show; ``NotARunError`` for the first path that is not a run."""
    for path in paths:
        check_run_folder(path)
    runs = []
    for path, name in zip(paths, unique_names(paths), strict=True):
        rows, warnings = read_metrics_tolerant(path / METRICS_FILE)
        runs.append(RunInput(path.resolve(), name, rows, list_dumps(path), warnings))
    return runs


_PAGE_FIELDS = (
    "index", "group", "sample", "data_source", "env_class", "prompt_text", "response_ids",
    "tokens", "loss_mask", "rollout_logprobs", "trainer_logprobs", "advantages",
    "token_rewards", "reward", "stop_reason", "solved", "turns", "router_flips",
    "router_flips_native",
)  # fmt: skip
_PER_TOKEN = (
    "tokens", "loss_mask", "rollout_logprobs", "trainer_logprobs", "advantages",
    "router_flips", "router_flips_native",
)  # fmt: skip


def page_document(document: dict[str, Any], path: Path) -> dict[str, Any]:
    """What the page needs of a dump (no prompt ids), checked so that the page can
    trust its shapes: a list that disagrees raises ``RolloutDumpError`` naming it."""
    trajectories = []
    for i, traj in enumerate(document["trajectories"]):
        if not isinstance(traj, dict):
            raise RolloutDumpError(path, f"trajectories[{i}]: expected an object")
        ids = traj.get("response_ids")
        if not isinstance(ids, list):
            raise RolloutDumpError(path, f"trajectories[{i}].response_ids: expected a list")
        for key in _PER_TOKEN:
            value = traj.get(key)
            if value is not None and (not isinstance(value, list) or len(value) != len(ids)):
                got = len(value) if isinstance(value, list) else type(value).__name__
                raise RolloutDumpError(
                    path,
                    f"trajectories[{i}].{key}: expected one per response token "
                    f"({len(ids)}), got {got}",
                )
        trajectories.append({key: traj.get(key) for key in _PAGE_FIELDS})
    keys = ("step", "kind", "num_layers", "num_experts", "expert_load", "group_size")
    return {**{key: document.get(key) for key in keys}, "trajectories": trajectories}
