"""Run folders (issue 25): a folder belongs to one run whatever its trackers wrote,
resuming below later checkpoints needs ``trainer.overwrite_later_checkpoints``, and
``trainer.resume_from=latest`` picks the newest checkpoint that verifies."""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from skyrl_train.config.compose import load_config
from skyrl_train.config.validate import validate_cfg
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.checkpoint import DRIVER_FILE, MANIFEST_FILE, begin_save, commit_save
from skyrl_train.runs.claim import hold_run_dir
from skyrl_train.runs.folder import (
    MARKER_FILE,
    RUN_ARTEFACTS,
    resolve_resume,
    run_artefacts,
    started_from,
)
from skyrl_train.utils.durable import write_file
from skyrl_train.utils.tracking import MetricsTracker, read_metrics
from tests.folder_snapshot import snapshot


def _save(root: Path, step: int, *, world_size: int = 1) -> Path:
    """A committed checkpoint, written by the helpers the training loop uses."""
    folder = begin_save(root, step=step)
    for rank in range(world_size):
        write_file(folder / f"policy_rank{rank}.pt", f"weights of step {step}".encode() * 64)
    write_file(folder / DRIVER_FILE, json.dumps({"step": step, "world_size": world_size}).encode())
    return commit_save(folder, step=step)


def _cfg(run_dir: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return load_config([f"trainer.run_dir={run_dir}", *overrides])


def claim_run_dir(cfg) -> Path:  # type: ignore[no-untyped-def]
    """What a launch does to its folder before it trains: hold it, then accept it."""
    with hold_run_dir(cfg) as claim:
        return claim.accept(cfg)


def _refused(run_dir: Path, *overrides: str) -> ConfigValidationError:
    with pytest.raises(ConfigValidationError) as info:
        validate_cfg(_cfg(run_dir, *overrides))
    assert str(info.value).startswith(info.value.path + ": ")
    return info.value


def _mkdir_with_file(path: Path, name: str) -> None:
    path.mkdir(parents=True)
    (path / name).write_bytes(b"events")


# One maker per kind of artefact a run leaves: (its name in the refusal, how to make it).
ARTEFACTS: dict[str, Callable[[Path], object]] = {
    MARKER_FILE: lambda d: (d / MARKER_FILE).write_text('{"format": "skyrl-r3-run"}\n'),
    "checkpoints/step_000001": lambda d: _save(d / "checkpoints", 1),
    "checkpoints/step_000002.tmp-1a2b3c4d": lambda d: (
        d / "checkpoints" / "step_000002.tmp-1a2b3c4d"
    ).mkdir(parents=True),
    "exports/global_step_1.tmp-1a2b3c4d": lambda d: (
        d / "exports" / "global_step_1.tmp-1a2b3c4d"
    ).mkdir(parents=True),
    "metrics.jsonl": lambda d: (d / "metrics.jsonl").write_bytes(b""),
    "metrics.png": lambda d: (d / "metrics.png").write_bytes(b"\x89PNG"),
    "rollouts/step_000001.json.gz": lambda d: _mkdir_with_file(
        d / "rollouts", "step_000001.json.gz"
    ),
    "main_base.log": lambda d: (d / "main_base.log").write_text("launch\n"),
    "engines/engine-0.log": lambda d: _mkdir_with_file(d / "engines", "engine-0.log"),
    "tensorboard": lambda d: _mkdir_with_file(d / "tensorboard", "events.out.tfevents.1"),
    "wandb": lambda d: _mkdir_with_file(d / "wandb", "debug.log"),
}


def test_every_kind_of_run_artefact_has_a_case_here() -> None:
    patterns = [pattern for pattern, _ in RUN_ARTEFACTS]
    covered = {p for name in ARTEFACTS for p in patterns if fnmatch.fnmatch(name, p)}
    assert covered == set(patterns)


@pytest.mark.parametrize("name", sorted(ARTEFACTS))
def test_any_one_run_artefact_refuses_a_fresh_launch_and_is_named(
    tmp_path: Path, name: str
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    validate_cfg(_cfg(run_dir))  # empty: a fresh launch may use it
    ARTEFACTS[name](run_dir)
    before = snapshot(run_dir)
    err = _refused(run_dir)
    assert err.path == "trainer.run_dir"
    assert f"holds {name} (" in err.reason
    assert "new trainer.run_dir" in err.reason
    assert snapshot(run_dir) == before
    # It suggests latest only where latest is accepted (issue 49): a lone artefact with
    # no run.json and no checkpoint says nothing of the run it came from.
    latest = _cfg(run_dir, "trainer.resume_from=latest")
    if "trainer.resume_from=latest" in err.reason:
        resolve_resume(latest)
    else:
        with pytest.raises(ConfigValidationError, match=r"^trainer\.resume_from: .*new trainer"):
            resolve_resume(latest)
    assert ("one of its checkpoints" in err.reason) == name.startswith("checkpoints/step_000001")
    assert snapshot(run_dir) == before


def test_a_refusal_names_a_few_artefacts_and_counts_the_rest(tmp_path: Path) -> None:
    for step in range(1, 7):
        _save(tmp_path / "checkpoints", step)
    err = _refused(tmp_path)
    assert "checkpoints/step_000004 (" in err.reason and "and 2 more" in err.reason
    assert "step_000005" not in err.reason


def test_a_sweep_job_folder_is_fresh_beside_its_finished_siblings(tmp_path: Path) -> None:
    # Hydra made <sweep>/1 before validation; job 0 ran; multirun.yaml is Hydra's.
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    for make in ARTEFACTS.values():
        make(sweep / "0")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "1").mkdir()
    (sweep / "notes.txt").write_text("not a run's\n")
    validate_cfg(_cfg(sweep / "1"))
    assert run_artefacts(sweep) == []
    assert _refused(sweep / "0").path == "trainer.run_dir"


# ------------------------------------------------------------- resuming below later ones


def test_resume_below_a_later_checkpoint_needs_the_explicit_key(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    step2, step4 = _save(root, 2), _save(root, 4)
    before = snapshot(tmp_path)
    err = _refused(tmp_path, f"trainer.resume_from={step2}")
    assert err.path == "trainer.overwrite_later_checkpoints"
    assert "step_000004" in err.reason and "from step 2" in err.reason
    assert err.reason.endswith("got false")
    assert snapshot(tmp_path) == before  # step 4 intact
    validate_cfg(
        _cfg(tmp_path, f"trainer.resume_from={step2}", "trainer.overwrite_later_checkpoints=true")
    )
    validate_cfg(_cfg(tmp_path, f"trainer.resume_from={step4}"))  # the newest: nothing later
    # A damaged later folder (no manifest) is not provably a checkpoint: pruning keeps
    # it (commit_save renames it aside), so it does not need the key.
    (tmp_path / "checkpoints" / "step_000004" / MANIFEST_FILE).unlink()
    validate_cfg(_cfg(tmp_path, f"trainer.resume_from={step2}"))


# ------------------------------------------------------------------------------ latest


def test_latest_picks_the_newest_checkpoint_that_verifies_naming_each_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    _save(root, 2)
    step4 = _save(root, 4)
    broken = _save(root, 6)
    (broken / MANIFEST_FILE).write_text("{")
    (root / "step_000008.tmp-0badc0de").mkdir()  # an unfinished save is never a candidate
    before = snapshot(tmp_path)
    cfg = _cfg(tmp_path, "trainer.resume_from=latest")
    validate_cfg(cfg)
    with caplog.at_level(logging.WARNING, logger="skyrl_train.runs.folder"):
        resolved = resolve_resume(cfg)
    assert resolved.trainer.resume_from == str(step4)
    assert cfg.trainer.resume_from == "latest"  # the caller's config is not changed
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"skipping {broken}: " in warning and "invalid JSON" in warning
    assert snapshot(tmp_path) == before
    validate_cfg(resolved)  # the resolved config passes the same checks


def test_latest_is_refused_below_a_damaged_later_checkpoint_pruning_would_delete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Same sizes, other bytes: the full hash skips it, but pruning's size check does
    # not, so resuming below it would delete it.
    root = tmp_path / "checkpoints"
    step2, step4 = _save(root, 2), _save(root, 4)
    rank_file = step4 / "policy_rank0.pt"
    rank_file.write_bytes(rank_file.read_bytes().replace(b"step 4", b"step 5"))
    with pytest.raises(ConfigValidationError) as info:
        resolve_resume(_cfg(tmp_path, "trainer.resume_from=latest"))
    assert info.value.path == "trainer.overwrite_later_checkpoints"
    assert "step_000004" in info.value.reason and "from step 2" in info.value.reason
    assert "expected sha256" in caplog.text
    resolved = resolve_resume(
        _cfg(tmp_path, "trainer.resume_from=latest", "trainer.overwrite_later_checkpoints=true")
    )
    assert resolved.trainer.resume_from == str(step2)


def test_latest_without_any_checkpoint_starts_fresh_only_where_no_run_wrote(
    tmp_path: Path,
) -> None:
    for run_dir in (tmp_path / "never_made", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        resolved = resolve_resume(_cfg(run_dir, "trainer.resume_from=latest"))
        assert resolved.trainer.resume_from is None
        validate_cfg(resolved)
    started = tmp_path / "started"
    started.mkdir()
    (started / "main_base.log").write_text("preempted before the first save\n")
    with pytest.raises(ConfigValidationError) as info:
        resolve_resume(_cfg(started, "trainer.resume_from=latest"))
    assert info.value.path == "trainer.resume_from"
    assert "got none," in info.value.reason and "main_base.log (the job log)" in info.value.reason
    assert "resume_from checkpoint" not in info.value.reason  # it has none to offer
    assert (started / "main_base.log").read_text() == "preempted before the first save\n"


def test_latest_with_only_damaged_checkpoints_names_each_and_why(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (_save(root, 2) / DRIVER_FILE).write_bytes(b"")
    (_save(root, 3) / "policy_rank0.pt").write_bytes(b"truncated")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigValidationError) as info:
        resolve_resume(_cfg(tmp_path, "trainer.resume_from=latest"))
    reason = info.value.reason
    assert info.value.path == "trainer.resume_from"
    assert "step_000003: " in reason and "policy_rank0.pt: expected" in reason
    assert "step_000002: " in reason and "driver.json: expected" in reason
    assert snapshot(tmp_path) == before


def test_latest_checks_the_world_size_it_resolved(tmp_path: Path) -> None:
    _save(tmp_path / "checkpoints", 1, world_size=2)
    with pytest.raises(ConfigValidationError) as info:
        resolve_resume(_cfg(tmp_path, "trainer.resume_from=latest"))
    assert info.value.path == "trainer.placement.num_trainers"


# ---------------------------------------------------------------- branches and markers


def test_a_branch_needs_a_fresh_folder_or_the_one_it_claimed(tmp_path: Path) -> None:
    origin = tmp_path / "a" / "checkpoints"
    step2, step4 = _save(origin, 2), _save(origin, 4)
    branch = tmp_path / "b"
    cfg = _cfg(branch, f"trainer.resume_from={step2}")
    validate_cfg(cfg)  # a fresh folder (not even made yet)
    claim_run_dir(resolve_resume(cfg))
    assert started_from(branch) == step2.resolve()
    validate_cfg(cfg)  # the same command resubmitted: its own folder
    (branch / "main_base.log").write_text("branch\n")
    validate_cfg(cfg)

    # Another checkpoint, a fresh launch, or a folder another run wrote: refused.
    err = _refused(branch, f"trainer.resume_from={step4}")
    assert err.path == "trainer.run_dir" and "run.json (" in err.reason
    assert _refused(branch).path == "trainer.run_dir"
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    err = _refused(other, f"trainer.resume_from={step2}")
    assert err.path == "trainer.run_dir" and "metrics.jsonl (" in err.reason

    # Once the branch saved step 3, resubmitting from step 2 would re-take it.
    branch_step3 = _save(branch / "checkpoints", 3)
    err = _refused(branch, f"trainer.resume_from={step2}")
    assert err.path == "trainer.overwrite_later_checkpoints" and "step_000003" in err.reason
    resumed = resolve_resume(_cfg(branch, "trainer.resume_from=latest"))
    assert resumed.trainer.resume_from == str(branch_step3)


def test_claim_writes_the_marker_once_and_then_a_fresh_launch_is_refused(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir)
    assert claim_run_dir(cfg) == run_dir
    marker = (run_dir / MARKER_FILE).read_bytes()
    record = json.loads(marker)
    assert record.pop("launched_by").keys() == {"pid", "host", "started_at"}
    assert record == {"format": "skyrl-r3-run", "started_from": None}
    assert started_from(run_dir) is None
    # A second fresh launch is refused under the lock too, and changes nothing.
    with pytest.raises(ConfigValidationError, match=r"^trainer\.run_dir: .*holds run\.json"):
        claim_run_dir(cfg)
    assert (run_dir / MARKER_FILE).read_bytes() == marker
    err = _refused(run_dir)
    assert f"holds {MARKER_FILE} (" in err.reason
    # Resuming from the folder's own checkpoint continues it; the marker stays.
    step1 = _save(run_dir / "checkpoints", 1)
    resumed = _cfg(run_dir, f"trainer.resume_from={step1}")
    validate_cfg(resumed)
    claim_run_dir(resolve_resume(resumed))
    assert (run_dir / MARKER_FILE).read_bytes() == marker


# ------------------------------------------------- a launch killed before its first save


def _killed_before_its_first_save(run_dir: Path) -> None:
    """What an accepted launch leaves when killed before step 3's save committed."""
    (run_dir / "main_base.log").write_text("launched\n")
    tracker = MetricsTracker(run_dir, start_step=0)
    tracker.log(1, {"reward": 0.1})
    tracker.log(2, {"reward": 0.2})
    (run_dir / "checkpoints" / "step_000003.tmp-1a2b3c4d").mkdir(parents=True)


def test_latest_starts_again_a_run_killed_before_its_first_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One command for a job's first launch and each resubmission (issue 49): before,
    # a plain relaunch was refused and told to use latest, and latest refused too.
    run_dir = tmp_path / "run"
    latest = _cfg(run_dir, "trainer.resume_from=latest")
    validate_cfg(latest)
    assert resolve_resume(latest).trainer.resume_from is None  # the first launch
    claim_run_dir(_cfg(run_dir))
    marker = (run_dir / MARKER_FILE).read_bytes()
    _killed_before_its_first_save(run_dir)

    err = _refused(run_dir)
    assert err.path == "trainer.run_dir"
    assert "start that run again from step 0 with trainer.resume_from=latest" in err.reason
    assert "one of its checkpoints" not in err.reason  # it has none

    validate_cfg(latest)
    with caplog.at_level(logging.WARNING, logger="skyrl_train.runs.folder"):
        with hold_run_dir(latest) as claim:
            resolved = resolve_resume(latest)
            claim.accept(resolved)
    assert resolved.trainer.resume_from is None
    assert "began fresh and saved no checkpoint: starting it again from step 0" in caplog.text
    assert (run_dir / MARKER_FILE).read_bytes() == marker  # still the run that began here
    # As a resume does after its checkpoint: the restarted run owns every step after
    # its start, so the killed launch's lines go when its tracker opens.
    MetricsTracker(run_dir, start_step=0).close()
    assert read_metrics(run_dir / "metrics.jsonl") == []


def test_latest_resumes_the_branch_point_of_a_branch_killed_before_its_first_save(
    tmp_path: Path,
) -> None:
    origin = tmp_path / "a" / "checkpoints"
    step2 = _save(origin, 2)
    _save(origin, 4)
    branch = tmp_path / "b"
    claim_run_dir(resolve_resume(_cfg(branch, f"trainer.resume_from={step2}")))
    (branch / "main_base.log").write_text("branched\n")
    MetricsTracker(branch, start_step=2).log(3, {"reward": 0.3})

    err = _refused(branch)
    assert f"resume that run from its branch point {str(step2.resolve())!r}" in err.reason
    assert "trainer.resume_from=latest" in err.reason
    latest = _cfg(branch, "trainer.resume_from=latest")
    with hold_run_dir(latest) as claim:
        resolved = resolve_resume(latest)
        claim.accept(resolved)
    assert resolved.trainer.resume_from == str(step2.resolve())  # not the origin's step 4
    assert claim.superseded is not None and claim.superseded.checkpoints == []
    assert started_from(branch) == step2.resolve()

    # The origin pruned the branch point: nothing can continue the branch, and neither
    # refusal suggests latest. The folder is left as it was.
    (step2 / DRIVER_FILE).write_bytes(b"")
    before = snapshot(branch)
    with pytest.raises(ConfigValidationError) as info:
        resolve_resume(latest)
    assert info.value.path == "trainer.resume_from"
    assert "or the branch point run.json names" in info.value.reason
    assert "driver.json: expected" in info.value.reason
    assert "resume_from=latest" not in _refused(branch).reason
    assert snapshot(branch) == before


def test_latest_leaves_a_run_whose_only_checkpoints_are_damaged_to_the_user(
    tmp_path: Path,
) -> None:
    # Past its start, a run is not restarted from step 0 over a checkpoint that may be
    # repairable: latest refuses naming it, and the plain launch's refusal offers no
    # command that would be refused too.
    run_dir = tmp_path / "run"
    claim_run_dir(_cfg(run_dir))
    (_save(run_dir / "checkpoints", 2) / MANIFEST_FILE).write_bytes(b"{")
    before = snapshot(run_dir)
    with pytest.raises(ConfigValidationError) as info:
        resolve_resume(_cfg(run_dir, "trainer.resume_from=latest"))
    assert info.value.path == "trainer.resume_from"
    assert "step_000002: " in info.value.reason
    assert "resume_from=latest" not in _refused(run_dir).reason
    assert snapshot(run_dir) == before
