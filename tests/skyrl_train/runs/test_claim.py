"""Holding and accepting a run folder (issue 38, ``runs/claim.py``): of two launches
started together into one free folder exactly one runs, the other refused naming it; a
branch deletes the history it supersedes as it is accepted, so a branch killed before
its first save resumes its branch point with ``latest``; a ``run_dir`` that is a file
is refused at validation; a launch refused under the lock leaves nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_train.config.compose import load_config
from skyrl_train.config.validate import validate_cfg
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.checkpoint import DRIVER_FILE, begin_save, commit_save
from skyrl_train.runs.claim import LOCK_FILE, hold_run_dir
from skyrl_train.runs.export import (
    FORMAT,
    MARKER_FILE,
    begin_export,
    commit_export,
    list_exports,
    read_marker,
)
from skyrl_train.runs.folder import check_run_dir_path, resolve_resume
from skyrl_train.runs.rollouts import list_dumps, write_dump
from skyrl_train.utils.durable import write_file
from skyrl_train.utils.tracking import MetricsTracker, read_metrics
from tests.folder_snapshot import snapshot

REPO = Path(__file__).resolve().parents[3]

CONTENDER = """
import json, os, sys
from skyrl_train.config.compose import load_config
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.claim import hold_run_dir

cfg = load_config([f"trainer.run_dir={sys.argv[1]}"])
print("ready", flush=True)
sys.stdin.readline()  # the start line, sent to both contenders at once
try:
    with hold_run_dir(cfg) as claim:
        claim.accept(cfg)
        print(json.dumps({"ran": os.getpid()}), flush=True)
        sys.stdin.readline()  # hold the folder until the test has both answers
except ConfigValidationError as exc:
    print(json.dumps({"refused": str(exc), "path": exc.path}), flush=True)
"""
"""One launch's claim of a fresh folder, as main_base.launch makes it."""

BRANCH = """
import sys
from skyrl_train.config.compose import load_config
from skyrl_train.runs.claim import hold_run_dir
from skyrl_train.runs.folder import resolve_resume
from skyrl_train.utils.tracking import MetricsTracker

run_dir, step2 = sys.argv[1], sys.argv[2]
cfg = load_config([f"trainer.run_dir={run_dir}", f"trainer.resume_from={step2}",
                   "trainer.overwrite_later_checkpoints=true"])
with hold_run_dir(cfg) as claim:
    cfg = resolve_resume(cfg)
    claim.accept(cfg)
    tracker = MetricsTracker(run_dir, start_step=2)
    tracker.log(3, {"reward": 0.5})  # the branch's step 3, logged before any save
    print("step 3 logged", flush=True)
    sys.stdin.readline()  # preempted here: SIGKILL
"""


def _python(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        assert proc.stderr is not None
        pytest.fail(f"the child exited with {proc.wait()}: {proc.stderr.read()[-3000:]}")
    return line.strip()


def _save(root: Path, step: int) -> Path:
    folder = begin_save(root, step=step)
    write_file(folder / "policy_rank0.pt", f"weights of step {step}".encode() * 64)
    write_file(folder / DRIVER_FILE, json.dumps({"step": step, "world_size": 1}).encode())
    return commit_save(folder, step=step)


def _export(run_dir: Path, step: int) -> Path:
    """An export of ``step`` as this run's export writer leaves it (its marker)."""
    folder = run_dir / "exports" / f"global_step_{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    marker = {"format": FORMAT, "step": step, "run_dir": str(run_dir.resolve())}
    (folder / MARKER_FILE).write_text(json.dumps(marker))
    return folder


# ------------------------------------------------------------------ two launches at once


def test_two_fresh_launches_started_together_exactly_one_runs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for round_ in range(2):
        folder = run_dir / str(round_)
        procs = [_python(CONTENDER, str(folder)) for _ in range(2)]
        try:
            assert [_line(p) for p in procs] == ["ready", "ready"]
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            answers = [json.loads(_line(p)) for p in procs]
            ran = [a["ran"] for a in answers if "ran" in a]
            refused = [a for a in answers if "refused" in a]
            assert len(ran) == 1 and len(refused) == 1, answers
            # Refused naming the launch that holds the folder, before any work.
            assert refused[0]["path"] == "trainer.run_dir"
            assert f"held by the launch of pid {ran[0]} on host " in refused[0]["refused"]
            assert (folder / "run.json").is_file()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    assert proc.stdin is not None
                    proc.stdin.write("\n")
                    proc.stdin.flush()
                assert proc.wait(timeout=60) == 0
        assert not (folder / LOCK_FILE).exists()  # released with the run


def test_a_launch_into_a_held_folder_is_refused_before_it_loads_any_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skyrl_train.dataset import prompts
    from skyrl_train.entrypoints.main_base import launch

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("datasets loaded for a launch into a held folder")

    monkeypatch.setattr(prompts, "load_datasets", must_not_run)
    cfg = load_config([f"trainer.run_dir={tmp_path / 'run'}"])
    with hold_run_dir(cfg):  # another launch, mid-run (flock: one per open file)
        with pytest.raises(ConfigValidationError) as info, launch(cfg):
            pytest.fail("launch must not yield into a held folder")
    assert info.value.path == "trainer.run_dir"
    assert f"pid {os.getpid()} on host " in info.value.reason and LOCK_FILE in info.value.reason


def test_a_launch_refused_under_the_lock_leaves_nothing(tmp_path: Path) -> None:
    nested = tmp_path / "runs" / "new"
    cfg = load_config([f"trainer.run_dir={nested}"])
    with pytest.raises(RuntimeError, match="a bad dataset row"), hold_run_dir(cfg):
        assert (nested / LOCK_FILE).is_file()
        raise RuntimeError("a bad dataset row")  # refused before accept
    assert list(tmp_path.iterdir()) == []  # neither runs/ nor runs/new
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("the user's\n")
    cfg = load_config([f"trainer.run_dir={existing}"])
    with pytest.raises(RuntimeError), hold_run_dir(cfg):
        raise RuntimeError("refused")
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]


# ------------------------------------------------------------------------------ a file


@pytest.mark.parametrize("evaluation", [False, True])
def test_a_run_dir_that_is_a_file_is_refused_at_validation(
    tmp_path: Path, evaluation: bool
) -> None:
    (tmp_path / "taken").write_text("a file\n")
    for run_dir, what in (
        (tmp_path / "taken", "the path is a file"),
        (tmp_path / "taken" / "run", f"{str(tmp_path / 'taken')!r}, above it, is a file"),
    ):
        with pytest.raises(ConfigValidationError) as info:
            validate_cfg(load_config([f"trainer.run_dir={run_dir}"]), evaluation=evaluation)
        assert info.value.path == "trainer.run_dir"
        assert str(info.value).endswith(f"got {str(run_dir)!r}: {what}")
    assert (tmp_path / "taken").read_text() == "a file\n"


def test_a_folder_made_by_another_launch_while_checked_is_not_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The two-launches test above lost this race once on 2 busy cores: the other
    # launch made the folder between two checks of the path (is_dir, then exists).
    run_dir = tmp_path / "run"
    real_is_dir = Path.is_dir

    def made_right_after(self: Path) -> bool:
        answer = real_is_dir(self)
        if self == run_dir:
            run_dir.mkdir(exist_ok=True)  # the other launch, just after this check
        return answer

    monkeypatch.setattr(Path, "is_dir", made_right_after)
    check_run_dir_path(str(run_dir))  # a folder, or a path where one can be made
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigValidationError, match="the path is a file"):
        check_run_dir_path(str(tmp_path / "file"))
    (tmp_path / "nowhere").symlink_to(tmp_path / "missing")
    with pytest.raises(ConfigValidationError, match="the path is a file"):
        check_run_dir_path(str(tmp_path / "nowhere"))


# ------------------------------------------------------------------------------ branches


def _old_run(run_dir: Path) -> dict[int, Path]:
    """A run that saved steps 2, 4, 6, exported 2 and 5 and logged steps 1-6."""
    saved = {step: _save(run_dir / "checkpoints", step) for step in (2, 4, 6)}
    for step in (2, 5):
        _export(run_dir, step)
    tracker = MetricsTracker(run_dir, start_step=0)
    for step in range(1, 7):
        tracker.log(step, {"reward": float(step)})
        write_dump(run_dir, {"step": step, "kind": "train", "trajectories": []})
    return saved


def test_accepting_a_branch_deletes_the_history_it_supersedes(tmp_path: Path) -> None:
    saved = _old_run(tmp_path)
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.resume_from={saved[2]}",
            "trainer.overwrite_later_checkpoints=true",
        ]
    )
    validate_cfg(cfg)
    with hold_run_dir(cfg) as claim:
        cfg = resolve_resume(cfg)
        claim.accept(cfg)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]
    assert [step for step, _ in list_exports(tmp_path / "exports")] == [2]
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["global_step_2"]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [ref.step for ref in list_dumps(tmp_path)] == [1, 2]  # the rollout dumps too
    assert claim.superseded is not None
    assert [p.name for p in claim.superseded.checkpoints] == ["step_000004", "step_000006"]
    assert claim.superseded.metrics_lines == 4


def test_resuming_from_the_newest_checkpoint_deletes_nothing(tmp_path: Path) -> None:
    # One history continued: its export of step 5 and its later metrics lines are its
    # own (the tracker drops the lines it logs again), not a superseded run's.
    saved = _old_run(tmp_path)
    for cfg in (
        load_config([f"trainer.run_dir={tmp_path}", f"trainer.resume_from={saved[6]}"]),
        load_config([f"trainer.run_dir={tmp_path}", "trainer.resume_from=latest"]),
    ):
        with hold_run_dir(cfg) as claim:
            claim.accept(resolve_resume(cfg))
        assert len(list((tmp_path / "checkpoints").iterdir())) == 3
        assert [step for step, _ in list_exports(tmp_path / "exports")] == [2, 5]
        assert len(read_metrics(tmp_path / "metrics.jsonl")) == 6
        assert len(list_dumps(tmp_path)) == 6


def test_a_branch_killed_before_its_first_save_resumes_its_branch_point(tmp_path: Path) -> None:
    saved = _old_run(tmp_path)
    branch = _python(BRANCH, str(tmp_path), str(saved[2]))
    try:
        assert _line(branch) == "step 3 logged"
        branch.send_signal(signal.SIGKILL)  # preempted, lock still held
        assert branch.wait(timeout=60) == -signal.SIGKILL
    finally:
        if branch.poll() is None:
            branch.kill()
            branch.wait(timeout=60)

    cfg = load_config([f"trainer.run_dir={tmp_path}", "trainer.resume_from=latest"])
    validate_cfg(cfg)
    with hold_run_dir(cfg) as claim:  # the kernel dropped the dead launch's lock
        resolved = resolve_resume(cfg)
        claim.accept(resolved)
    assert resolved.trainer.resume_from == str(saved[2])  # not the old run's step 6
    # The resumed run's tracker drops the killed branch's step 3; no line of the old
    # run's steps 3-6 is left to interleave with the branch's.
    MetricsTracker(tmp_path, start_step=2).close()
    rewards = [(r["step"], r["reward"]) for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert rewards == [(1, 1.0), (2, 2.0)]


def _script_export(run_dir: Path, step: int) -> Path:
    """An export of ``step`` as ``scripts/export_hf.py --out <run_dir>/exports/...``
    writes it: ``PolicyGroup.export_hf`` with the script's arguments (``key="--out"``,
    no ``run_dir``), so its marker names no run."""
    source = run_dir.parent / "model"
    source.mkdir(exist_ok=True)
    (source / "config.json").write_text('{"model_type": "qwen2_moe"}\n')
    (source / "generation_config.json").write_text('{"eos_token_id": 2}\n')
    final = run_dir / "exports" / f"global_step_{step}"
    temp = begin_export(final, key="--out")
    write_file(temp / "model.safetensors", b"weights the user exported by hand")
    commit_export(temp, final, source=source, step=step, key="--out")
    return final


def test_a_branch_deletes_only_the_exports_and_checkpoints_its_run_wrote(
    tmp_path: Path,
) -> None:
    # A change that deleted every later export passed the whole suite (issue 49): here
    # the user's own export of step 4 (scripts/export_hf.py), another run's export of
    # step 6, a model folder and notes they keep beside the run's, all above the
    # branch point, must come through the branch whole.
    run_dir = tmp_path / "run"
    saved = _old_run(run_dir)
    by_script = _script_export(run_dir, 4)
    assert read_marker(by_script) is not None and read_marker(by_script)["run_dir"] is None
    by_other_run = _export(tmp_path / "other", 6)
    os.rename(by_other_run, run_dir / "exports" / "global_step_6")
    (run_dir / "exports" / "global_step_7").mkdir()
    (run_dir / "exports" / "global_step_7" / "model.safetensors").write_bytes(b"the user's")
    (run_dir / "exports" / "notes.txt").write_text("step 4 looked best\n")
    (run_dir / "checkpoints" / "step_000009").mkdir()  # no manifest: not a checkpoint
    (run_dir / "checkpoints" / "step_000009" / "policy_rank0.pt").write_bytes(b"copied in")
    (run_dir / "notes.txt").write_text("run notes\n")
    foreign = {
        name: snapshot(run_dir / name)
        for name in (
            "exports/global_step_4",
            "exports/global_step_6",
            "exports/global_step_7",
            "checkpoints/step_000009",
        )
    }

    cfg = load_config(
        [
            f"trainer.run_dir={run_dir}",
            f"trainer.resume_from={saved[2]}",
            "trainer.overwrite_later_checkpoints=true",
        ]
    )
    validate_cfg(cfg)
    with hold_run_dir(cfg) as claim:
        claim.accept(resolve_resume(cfg))

    assert claim.superseded is not None
    assert [p.name for p in claim.superseded.exports] == ["global_step_5"]
    assert [p.name for p in claim.superseded.checkpoints] == ["step_000004", "step_000006"]
    assert sorted(p.name for p in (run_dir / "exports").iterdir()) == [
        "global_step_2",
        "global_step_4",
        "global_step_6",
        "global_step_7",
        "notes.txt",
    ]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000009",
    ]
    for name, before in foreign.items():
        assert snapshot(run_dir / name) == before, name
    assert (run_dir / "exports" / "notes.txt").read_text() == "step 4 looked best\n"
    assert (run_dir / "notes.txt").read_text() == "run notes\n"
