"""What a run leaves in ``trainer.run_dir``, and which launches may write there.

A run folder belongs to one run: the launch that found it free, then the launches that
continue that run from its checkpoints. The rules, checked before Ray starts
(``check_run_dir`` from ``validate_cfg`` and again under the folder's lock,
``resolve_resume`` from the launch; the lock and the acceptance that writes ``run.json``
are ``runs.claim``'s):

- ``run_dir`` is a folder, or a path one can be made at: a file there (or at any
  folder above it) is refused.

- A fresh launch (``trainer.resume_from`` null) needs a folder holding none of
  ``RUN_ARTEFACTS``. Other entries are not a run's: a ``-m`` sweep's job folders
  (``<run_dir>/N``, each validated on its own) and its ``multirun.yaml`` never make a
  job refuse itself.
- Resuming from ``<run_dir>/checkpoints/step_N`` continues that run. Its saves re-take
  the steps after N and its pruning deletes higher steps first, so a folder holding
  checkpoints above step N is refused unless ``trainer.overwrite_later_checkpoints``,
  and with it the launch deletes them, as it is accepted (``runs.claim``).
- Resuming from another folder's checkpoint branches a new run: ``run_dir`` must hold
  no run artefacts, or be the folder an earlier launch of this same branch claimed
  (its ``run.json`` names the same checkpoint: a resubmitted job); the rule above then
  applies to the checkpoints that launch saved.
- ``trainer.resume_from=latest`` resolves once, at launch, to the newest checkpoint
  under ``<run_dir>/checkpoints`` that verifies in full, naming each damaged one above
  it in a warning. With none (and no damaged one), the run the folder's ``run.json``
  records continues from where it began: a run that began fresh starts again from step
  0 (a job killed before its first save and resubmitted), a branch resumes its branch
  point, and a folder without run artefacts starts fresh (a job resubmitted before it
  ever ran). Any other folder is refused: no command could tell which run it holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from skyrl_train.errors import CheckpointError, ConfigValidationError
from skyrl_train.runs.checkpoint import (
    RESUME_KEY,
    STEP_DIR,
    Checkpoint,
    list_checkpoints,
    newest_checkpoint,
    verify_checkpoint,
)
from skyrl_train.runs.export import EXPORTS_DIR, export_root, list_exports, read_marker
from skyrl_train.runs.resume import check_resumable, verify_resume

if TYPE_CHECKING:
    from skyrl_train.config.schema import PPOConfig, TrainerConfig

logger = logging.getLogger(__name__)

LATEST = "latest"
"""``trainer.resume_from=latest``: the newest checkpoint of ``run_dir`` that verifies."""
CHECKPOINTS_DIR = "checkpoints"
MARKER_FILE = "run.json"
MARKER_FORMAT = "skyrl-r3-run"

RUN_ARTEFACTS: tuple[tuple[str, str], ...] = (
    (MARKER_FILE, "the marker a launch writes first"),
    (f"{CHECKPOINTS_DIR}/step_*", "a checkpoint or an unfinished save"),
    ("metrics.jsonl*", "the jsonl tracker's metrics"),
    ("tensorboard", "the tensorboard tracker's events"),
    ("wandb", "the wandb tracker's files"),
    (f"{EXPORTS_DIR}/global_step_*", "a Hugging Face export or an unfinished one"),
    ("metrics.png", "the end-of-run plot"),
    ("rollouts/*.json.gz", "a rollout dump (logging.dump_rollouts)"),
    ("main_base.log", "the job log"),
    ("engines/engine-*.log", "an inference engine's log"),
)
"""Glob patterns, under ``run_dir``, of everything a run writes there, and what each
is, in the order a refusal names them: a run's results before its logs, which every
launch writes and which say least about what would be lost. The mlflow tracker writes
nothing there (its store is MLflow's own setting)."""

_LISTED = 4
"""Artefacts a refusal names one by one; more are counted."""


def run_artefacts(run_dir: str | Path) -> list[tuple[Path, str]]:
    """The ``RUN_ARTEFACTS`` that ``run_dir`` holds: ``(path, what it is)``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return [
        (path, what) for pattern, what in RUN_ARTEFACTS for path in sorted(run_dir.glob(pattern))
    ]


def check_run_dir_path(run_dir: str) -> None:
    """Refuse a ``trainer.run_dir`` that is a file, or lies under one: the launch could
    never create the folder (``mkdir`` raised a bare FileExistsError after the checks)."""
    path = Path(run_dir)
    for folder in (path, *path.parents):
        # One stat decides: a launch started beside this one may create the folder
        # between two checks (is_dir, then exists), and it then looked like a file.
        try:
            if stat.S_ISDIR(folder.stat().st_mode):
                return
        except (FileNotFoundError, NotADirectoryError):  # absent, or under a file
            if not folder.is_symlink():  # a link to nothing counts as a file
                continue
        what = "the path" if folder == path else f"{str(folder)!r}, above it,"
        raise ConfigValidationError(
            "trainer.run_dir",
            expected="a folder, or a path where one can be made",
            got=f"{run_dir!r}: {what} is a file",
        )


def check_run_dir(trainer: TrainerConfig) -> None:
    """Refuse a launch that would write into another run's folder, or resume below
    checkpoints it would delete without ``trainer.overwrite_later_checkpoints``.
    ``latest`` is checked when the launch resolves it (``resolve_resume``)."""
    run_dir, resume = Path(trainer.run_dir), trainer.resume_from
    check_run_dir_path(trainer.run_dir)
    _check_export_path(trainer)
    if resume == LATEST:
        return
    found = run_artefacts(run_dir)
    if resume is None:
        if found:
            raise ConfigValidationError(
                "trainer.run_dir",
                expected="a folder no other run has written to (pick a new "
                f"trainer.run_dir{_ways_to_continue(run_dir)})",
                got=f"{str(run_dir)!r}, which holds {_describe(run_dir, found)}",
            )
        return
    checkpoint = Path(resume).resolve()
    own = checkpoint.parent == (run_dir / CHECKPOINTS_DIR).resolve()
    if not own:
        if not found:
            return
        if started_from(run_dir) != checkpoint:
            raise ConfigValidationError(
                "trainer.run_dir",
                expected=f"a fresh folder for a run branched from {str(checkpoint)!r} "
                f"(pick a new trainer.run_dir{_ways_to_continue(run_dir)})",
                got=f"{str(run_dir)!r}, which holds {_describe(run_dir, found)}",
            )
    check_later_checkpoints(trainer, checkpoint, suggest_latest=True)


def resolve_resume(cfg: PPOConfig) -> PPOConfig:
    """``cfg`` with ``trainer.resume_from`` hashed against its manifest and ``latest``
    resolved to a folder (or None: a fresh start). The launch calls this once, before
    Ray starts, and everything after reads the returned config."""
    tr = cfg.trainer
    if tr.resume_from != LATEST:
        verify_resume(cfg)
        return cfg
    run_dir = Path(tr.run_dir)
    root = run_dir / CHECKPOINTS_DIR
    found, skipped = newest_checkpoint(root)
    for folder, exc in skipped:
        logger.warning("trainer.resume_from=latest: skipping %s: %s", folder, exc)
    if found is None:
        found = _without_checkpoint(run_dir, skipped)
    if found is None:
        resolved = None
    else:
        check_resumable(found, strategy=tr.strategy, num_trainers=tr.placement.num_trainers)
        logger.info("trainer.resume_from=latest: resuming from %s", found.folder)
        resolved = str(found.folder)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(tr, resume_from=resolved))
    if found is not None:
        # Only damaged ones can sit above the newest good checkpoint; the sizes of
        # some still check out, and pruning would delete those (list_checkpoints).
        check_later_checkpoints(cfg.trainer, found.folder, suggest_latest=False)
    return cfg


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A run folder's ``run.json``, written by the launch that first accepted it."""

    started_from: Path | None
    """The other folder's checkpoint the run branched from; None: it began fresh."""


def run_record(run_dir: str | Path) -> RunRecord | None:
    """``run_dir``'s ``run.json``; None when it is absent, unreadable or not ours."""
    try:
        record = json.loads((Path(run_dir) / MARKER_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != MARKER_FORMAT:
        return None
    value = record.get("started_from")
    if value is not None and not isinstance(value, str):
        return None
    return RunRecord(started_from=Path(value) if value else None)


def started_from(run_dir: str | Path) -> Path | None:
    """The other folder's checkpoint ``run_dir``'s run branched from (its ``run.json``);
    None when it started fresh, has no readable marker, or its marker is not ours."""
    record = run_record(run_dir)
    return record.started_from if record is not None else None


def _without_checkpoint(
    run_dir: Path, skipped: list[tuple[Path, CheckpointError]]
) -> Checkpoint | None:
    """What ``latest`` resumes where ``<run_dir>/checkpoints`` holds no checkpoint that
    verifies (``skipped``: the damaged ones): nothing, a fresh start, where no run wrote
    or where the folder's run began fresh and never saved; the branch point of a branch
    that never saved. Refuses any other folder."""
    root = run_dir / CHECKPOINTS_DIR
    artefacts = run_artefacts(run_dir)
    if not artefacts:
        logger.info("trainer.resume_from=latest: no checkpoint under %s, starting fresh", root)
        return None
    # A damaged checkpoint means the run got past its start: restarting it would
    # replace steps it may have saved, so the user decides (the refusal names each).
    record = run_record(run_dir) if not skipped else None
    if record is None:
        why = "; ".join(f"{folder.name}: {exc}" for folder, exc in skipped)
        unknown = "" if skipped else f" without a {MARKER_FILE} saying how its run began"
        raise ConfigValidationError(
            RESUME_KEY,
            expected=f"a checkpoint under {str(root)!r} whose files verify",
            got=f"{'none that does (' + why + ')' if skipped else 'none'}, in a folder "
            f"another launch wrote{unknown} ({_describe(run_dir, artefacts)}); pick a new "
            "trainer.run_dir",
        )
    if record.started_from is None:
        # As a resume re-takes the steps after its checkpoint: the tracker drops the
        # killed launch's metrics lines after step 0, its exports are replaced as the
        # steps come again.
        logger.warning(
            "trainer.resume_from=latest: the run in %s began fresh and saved no "
            "checkpoint: starting it again from step 0 (%s)",
            run_dir,
            _describe(run_dir, artefacts),
        )
        return None
    try:
        found = verify_checkpoint(record.started_from)
    except CheckpointError as exc:
        raise ConfigValidationError(
            RESUME_KEY,
            expected=f"a checkpoint under {str(root)!r}, or the branch point "
            f"{MARKER_FILE} names, whose files verify",
            got=f"none under it, and the branch point: {exc}",
        ) from exc
    logger.info(
        "trainer.resume_from=latest: the branch in %s saved no checkpoint: resuming its "
        "branch point %s",
        run_dir,
        found.folder,
    )
    return found


def _ways_to_continue(run_dir: Path) -> str:
    """The launches that would continue the run in ``run_dir``, as a refusal's
    suggestion (``, or ...``), or "" where none would: a refusal names only what
    works. Checkpoints count by size (``list_checkpoints``): hashing a run's every
    checkpoint only to word a refusal would cost minutes; ``latest`` hashes the one it
    picks and names each it skips."""
    root = run_dir / CHECKPOINTS_DIR
    if list_checkpoints(root):
        return ", or continue that run with trainer.resume_from=latest or one of its checkpoints"
    record = run_record(run_dir)
    damaged = root.is_dir() and any(
        STEP_DIR.fullmatch(path.name) and path.is_dir() for path in root.iterdir()
    )
    if record is None or damaged:
        return ""
    if record.started_from is None:
        return (
            ", or start that run again from step 0 with trainer.resume_from=latest (it "
            "saved no checkpoint)"
        )
    try:
        verify_checkpoint(record.started_from, hash_files=False)
    except CheckpointError:
        return ""
    return (
        ", or resume that run from its branch point "
        f"{str(record.started_from)!r} with trainer.resume_from=latest (it saved no checkpoint)"
    )


def _check_export_path(trainer: TrainerConfig) -> None:
    """Refuse an explicit ``trainer.export_path`` holding another run's exports: this
    run's export of the same step would replace it. (Under ``run_dir`` the rules above
    already keep other runs out.)"""
    if trainer.export_path is None:
        return
    own = str(Path(trainer.run_dir).resolve())
    for _, folder in list_exports(export_root(trainer.export_path, trainer.run_dir)):
        writer = (read_marker(folder) or {}).get("run_dir")
        if writer is not None and writer != own:
            raise ConfigValidationError(
                "trainer.export_path",
                expected=f"a folder without other runs' exports (those of {own!r}), since "
                "this run's exports would replace theirs step for step",
                got=f"{str(folder)!r}, exported by the run in {writer!r}",
            )


def check_later_checkpoints(
    trainer: TrainerConfig, checkpoint: Path, *, suggest_latest: bool
) -> None:
    """Refuse resuming from ``checkpoint`` below the checkpoints of ``run_dir`` unless
    ``trainer.overwrite_later_checkpoints``."""
    root = Path(trainer.run_dir) / CHECKPOINTS_DIR
    step = verify_checkpoint(checkpoint, hash_files=False).step
    later = [c.folder.name for c in list_checkpoints(root) if c.step > step]
    if later and not trainer.overwrite_later_checkpoints:
        hint = (
            "; or resume from the newest with trainer.resume_from=latest" if suggest_latest else ""
        )
        raise ConfigValidationError(
            "trainer.overwrite_later_checkpoints",
            expected=f"true to resume from step {step} ({str(checkpoint)!r}) into "
            f"{str(root)!r}, which holds later checkpoints ({', '.join(later)}) that this "
            f"launch would delete{hint}",
            got="false",
        )


def _describe(run_dir: Path, found: list[tuple[Path, str]]) -> str:
    named = [f"{path.relative_to(run_dir)} ({what})" for path, what in found[:_LISTED]]
    if len(found) > _LISTED:
        named.append(f"and {len(found) - _LISTED} more")
    return ", ".join(named)
