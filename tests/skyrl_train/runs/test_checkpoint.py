"""Crash-safe checkpoint folders: atomic save, manifest verification before any
torch.load, stale temp folders, retention, and the driver's save/load through GRPOLoop."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from skyrl_train.config.compose import load_config
from skyrl_train.config.validate import validate_cfg
from skyrl_train.errors import CheckpointError, ConfigValidationError, NonFiniteError
from skyrl_train.runs import checkpoint as ckpt
from skyrl_train.runs.checkpoint import (
    DRIVER_FILE,
    MANIFEST_FILE,
    begin_save,
    commit_save,
    prune_checkpoints,
    remove_stale_saves,
    verify_checkpoint,
)
from skyrl_train.runs.rank_file import checkpoint_file, save_rank_state
from skyrl_train.runs.resume import load_rank_state, verify_resume
from skyrl_train.trainer.loop import GRPOLoop
from skyrl_train.utils.durable import write_file

REPO = Path(__file__).resolve().parents[3]


def _save(root: Path, step: int, *, world_size: int = 1, extra: bytes = b"") -> Path:
    """A committed checkpoint as the driver writes one: rank files, driver.json."""
    folder = begin_save(root, step=step)
    for rank in range(world_size):
        state = {"world_size": world_size, "w": torch.arange(64.0) + step, "pad": extra.decode()}
        save_rank_state(checkpoint_file(folder, rank), state)
    write_file(folder / DRIVER_FILE, json.dumps({"step": step, "world_size": world_size}).encode())
    return commit_save(folder, step=step)


def _no_torch_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("verification must refuse the file before any torch.load")

    monkeypatch.setattr(torch, "load", refuse)


def _refusal(folder: Path, **kwargs: bool) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(folder, **kwargs)
    message = str(info.value)
    assert message.startswith("trainer.resume_from: ")
    assert str(info.value.file) in message and "expected" in message and "got" in message
    return info.value


# ---------------------------------------------------------------------- the good path


def test_save_is_atomic_and_verifies(tmp_path: Path) -> None:
    final = _save(tmp_path, 10, world_size=2)
    assert final == tmp_path / "step_000010"
    assert [p.name for p in tmp_path.iterdir()] == ["step_000010"]  # no temp folder left
    names = sorted(p.name for p in final.iterdir())
    assert names == [DRIVER_FILE, MANIFEST_FILE, "policy_rank0.pt", "policy_rank1.pt"]
    manifest = json.loads((final / MANIFEST_FILE).read_text())
    assert manifest["format_version"] == 1 and manifest["step"] == 10
    for entry in manifest["files"]:
        data = (final / entry["name"]).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    found = verify_checkpoint(final)
    assert (found.step, found.world_size, len(found.files)) == (10, 2, 3)
    state = load_rank_state(final, rank=1, world_size=2)
    assert torch.equal(state["w"], torch.arange(64.0) + 10)


def test_a_step_saved_again_replaces_the_old_folder_whole(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    _save(tmp_path, 3, extra=b"second")
    assert [p.name for p in tmp_path.iterdir()] == ["step_000003"]
    assert torch.load(tmp_path / "step_000003" / "policy_rank0.pt")["pad"] == "second"
    verify_checkpoint(tmp_path / "step_000003")


def test_a_step_folder_that_is_no_checkpoint_is_kept_aside_not_deleted(tmp_path: Path) -> None:
    (tmp_path / "step_000003").mkdir()
    (tmp_path / "step_000003" / "mine.txt").write_text("keep me")
    _save(tmp_path, 3)
    verify_checkpoint(tmp_path / "step_000003")
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith("step_000003.replaced-")]
    assert (kept / "mine.txt").read_text() == "keep me"
    _save(tmp_path, 4)  # not a temp folder: later saves leave it alone too
    assert kept.is_dir()


# ----------------------------------------------------------------- damaged checkpoints


@pytest.mark.parametrize("count", [1, 64])
def test_corrupted_bytes_in_a_pt_are_refused_before_torch_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    final = _save(tmp_path, 1)
    target = final / "policy_rank0.pt"
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    target.write_bytes(bytes(data))
    _no_torch_load(monkeypatch)
    err = _refusal(final)
    assert err.file == target
    assert err.expected.startswith("sha256 ") and err.got.startswith("sha256 ")
    # Sizes alone cannot see it: the structural check used for pruning passes.
    verify_checkpoint(final, hash_files=False)


def test_a_half_written_file_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = _save(tmp_path, 1)
    target = final / "policy_rank0.pt"
    size = target.stat().st_size
    os.truncate(target, size // 2)
    _no_torch_load(monkeypatch)
    err = _refusal(final, hash_files=False)
    assert err.file == target
    assert (err.expected, err.got) == (
        f"{size} bytes",
        f"{size // 2} bytes (truncated, half-written or replaced)",
    )


def test_a_missing_or_an_extra_file_is_refused_naming_it(tmp_path: Path) -> None:
    final = _save(tmp_path, 1, world_size=2)
    (final / "policy_rank1.pt").unlink()
    err = _refusal(final)
    assert err.file == final / "policy_rank1.pt" and err.got == "no such file"
    other = _save(tmp_path, 2)
    (other / "notes.txt").write_text("hello")
    err = _refusal(other)
    assert err.file == other / "notes.txt" and err.got == "an extra file"


def test_an_empty_driver_json_is_refused_naming_it(tmp_path: Path) -> None:
    final = _save(tmp_path, 1)
    (final / DRIVER_FILE).write_bytes(b"")
    err = _refusal(final)
    assert err.file == final / DRIVER_FILE and err.got.startswith("0 bytes")
    # An empty driver.json the manifest vouches for (a buggy writer) names it too.
    folder = begin_save(tmp_path, step=5)
    write_file(folder / DRIVER_FILE, b"")
    err = _refusal(commit_save(folder, step=5))
    assert err.file == tmp_path / "step_000005" / DRIVER_FILE and err.got == "an empty file"


@pytest.mark.parametrize(
    ("content", "got"),
    [
        (None, "no such file (an unfinished save, or one from before manifests)"),
        (b"", "an empty file"),
        (b'{"format": ', "invalid JSON (Expecting value at line 1 column 12)"),
        (b"[1, 2]", "a JSON list"),
        (
            b'{"format": "skyrl-r3-checkpoint", "format_version": 2, "step": 1, "files": []}',
            "format 'skyrl-r3-checkpoint' version 2",
        ),
        (
            b'{"format": "skyrl-r3-checkpoint", "format_version": 1, "step": 1, '
            b'"files": [{"name": "../x", "size": 1, "sha256": "00"}]}',
            "'../x'",
        ),
    ],
)
def test_a_missing_or_bad_manifest_is_refused_naming_it(
    tmp_path: Path, content: bytes | None, got: str
) -> None:
    final = _save(tmp_path, 1)
    manifest = final / MANIFEST_FILE
    if content is None:
        manifest.unlink()
    else:
        manifest.write_bytes(content)
    err = _refusal(final)
    assert err.file == manifest
    assert err.got == got


def test_load_rank_state_names_the_file_torch_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "policy_rank0.pt").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(CheckpointError, match=r"^trainer.resume_from: .*policy_rank0.pt: ") as info:
        load_rank_state(tmp_path, rank=0, world_size=1)
    assert info.value.expected == "a rank state torch.load can read"


def test_load_rank_state_refuses_another_pipeline_layout(tmp_path: Path) -> None:
    layout = {
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 1,
    }
    state = {"world_size": 2, "layout": layout, "w": torch.zeros(2)}
    save_rank_state(checkpoint_file(tmp_path, 1), state)
    assert load_rank_state(tmp_path, rank=1, world_size=2, layout=layout)["layout"] == layout
    other = {**layout, "virtual_pipeline_model_parallel_size": None}
    with pytest.raises(ConfigValidationError) as info:
        load_rank_state(tmp_path, rank=1, world_size=2, layout=other)
    assert info.value.path == "trainer.policy.megatron_config.virtual_pipeline_model_parallel_size"
    assert "expected the checkpoint's 2" in info.value.reason and "got None" in info.value.reason


# ------------------------------------------------------------- temp folders and crashes


def test_stale_temp_folders_are_never_resumed_and_cleaned_by_the_next_save(
    tmp_path: Path,
) -> None:
    _save(tmp_path, 1)
    stale = begin_save(tmp_path, step=2)
    write_file(stale / DRIVER_FILE, b'{"step": 2, "world_size": 1}')
    err = _refusal(stale)
    assert err.got == "the temp folder of a save that never finished"
    # Pruning never counts it, and the next save removes it.
    assert prune_checkpoints(tmp_path, keep=1, current_step=1) == []
    assert stale.is_dir()
    _save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]
    assert remove_stale_saves(tmp_path) == []


def test_a_save_killed_between_two_files_leaves_the_previous_checkpoint_whole(
    tmp_path: Path,
) -> None:
    previous = _save(tmp_path, 1)
    before = {p.name: p.read_bytes() for p in previous.iterdir()}
    # A real kill -9 after the first rank file is on disk, the second not yet written.
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from skyrl_train.runs.checkpoint import begin_save
        from skyrl_train.utils.durable import write_file
        folder = begin_save(Path({str(tmp_path)!r}), step=2)
        write_file(folder / "policy_rank0.pt", b"x" * 4096)
        print(folder, flush=True)
        time.sleep(60)
        write_file(folder / "policy_rank1.pt", b"y" * 4096)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        partial = Path(proc.stdout.readline().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert partial.is_dir() and partial.name.startswith("step_000002.tmp-")
    assert not (tmp_path / "step_000002").exists()
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == before
    assert verify_checkpoint(previous).step == 1
    _refusal(partial)
    _save(tmp_path, 2)  # the next save cleans it up
    assert not partial.exists()


def test_a_failed_rename_leaves_a_temp_folder_never_taken_for_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    previous = _save(tmp_path, 1)

    def crash(src: object, dst: object) -> None:
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(ckpt.os, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, 2)
    monkeypatch.undo()
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith("step_000002.tmp-")]
    assert (partial / MANIFEST_FILE).is_file()  # complete, but under a temp name
    _refusal(partial)
    assert verify_checkpoint(previous).step == 1


# ---------------------------------------------------------------------------- retention


def test_max_ckpts_to_keep_keeps_the_newest_and_touches_nothing_else(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    (tmp_path / "step_000000").mkdir()  # no manifest: not provably a checkpoint
    (tmp_path / "notes").mkdir()
    mislabelled = _save(tmp_path, 7)
    os.rename(mislabelled, tmp_path / "step_000008")  # manifest says 7: not ours to judge
    _save(tmp_path, 4)
    assert prune_checkpoints(tmp_path, keep=-1, current_step=4) == []
    assert prune_checkpoints(tmp_path, keep=None, current_step=4) == []
    removed = prune_checkpoints(tmp_path, keep=2, current_step=4)
    assert sorted(p.name for p in removed) == ["step_000001", "step_000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes",
        "step_000000",
        "step_000003",
        "step_000004",
        "step_000008",
    ]
    assert prune_checkpoints(tmp_path, keep=1, current_step=4) == [tmp_path / "step_000003"]


def test_after_a_resume_the_abandoned_later_steps_go_first(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    # Resumed from step 2, the run has just re-taken step 3: step 4 is the old run's.
    _save(tmp_path, 3, extra=b"resumed")
    removed = prune_checkpoints(tmp_path, keep=2, current_step=3)
    assert sorted(p.name for p in removed) == ["step_000001", "step_000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]


@pytest.mark.parametrize(
    ("value", "ok"), [("-1", True), ("null", True), ("3", True), ("0", False), ("-2", False)]
)
def test_max_ckpts_to_keep_is_validated(value: str, ok: bool) -> None:
    cfg = load_config([f"trainer.max_ckpts_to_keep={value}"])
    if ok:
        validate_cfg(cfg)
        return
    with pytest.raises(ConfigValidationError, match="expected -1 or an int >= 1") as info:
        validate_cfg(cfg)
    assert info.value.path == "trainer.max_ckpts_to_keep"


# ------------------------------------------------------------ the driver's side, no Ray


class FilePolicy:
    """Writes each rank's file as PolicyTrainer does; ``fail_rank`` raises instead."""

    def __init__(self, world_size: int, *, fail_rank: int | None = None) -> None:
        self.world_size = world_size
        self.fail_rank = fail_rank
        self.loaded: list[str] = []

    async def save_checkpoint(self, folder: str) -> None:
        for rank in range(self.world_size):
            if rank == self.fail_rank:
                raise RuntimeError(f"rank {rank} died mid-save")
            write_file(checkpoint_file(Path(folder), rank), f"rank {rank}".encode())

    async def load_checkpoint(self, folder: str) -> None:
        self.loaded.append(folder)


def _loop(tmp_path: Path, policy: FilePolicy, *overrides: str) -> GRPOLoop:
    cfg = load_config(
        [
            f"trainer.run_dir={tmp_path}",
            f"trainer.placement.num_trainers={policy.world_size}",
            "trainer.policy_mini_batch_size=4",
            "trainer.train_batch_size=4",
            *overrides,
        ]
    )
    return GRPOLoop(cfg, tokenizer=None, server_urls=[], policy=policy, pad_token_id=0)


def test_loop_saves_prunes_and_resumes_through_the_manifest(tmp_path: Path) -> None:
    policy = FilePolicy(2)
    loop = _loop(tmp_path, policy, "trainer.max_ckpts_to_keep=2")
    for step in (1, 2, 3):
        asyncio.run(loop.save_checkpoint(step))
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]
    assert json.loads((root / "step_000003" / DRIVER_FILE).read_text()) == {
        "step": 3,
        "world_size": 2,
    }
    assert asyncio.run(loop.load_checkpoint(root / "step_000002")) == 2
    assert policy.loaded == [str(root / "step_000002")]
    cfg = load_config(
        [f"trainer.resume_from={root / 'step_000003'}", "trainer.placement.num_trainers=2"]
    )
    assert verify_resume(cfg) is not None and verify_resume(load_config([])) is None


def test_loop_save_that_fails_on_a_rank_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    asyncio.run(_loop(tmp_path, FilePolicy(2)).save_checkpoint(1))
    failing = _loop(tmp_path, FilePolicy(2, fail_rank=1))
    with pytest.raises(RuntimeError, match="rank 1 died"):
        asyncio.run(failing.save_checkpoint(2))
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step_000001"]
    assert verify_checkpoint(root / "step_000001").step == 1


def test_resume_at_another_world_size_is_refused_before_launch(tmp_path: Path) -> None:
    final = _save(tmp_path, 1, world_size=2)
    cfg = load_config([f"trainer.resume_from={final}"])
    with pytest.raises(ConfigValidationError, match="world size 2") as info:
        verify_resume(cfg)
    assert info.value.path == "trainer.placement.num_trainers"


def test_error_tree() -> None:
    for cls in (CheckpointError, NonFiniteError):
        assert issubclass(cls, ValueError) and not issubclass(cls, ConfigValidationError)
    err = CheckpointError("trainer.resume_from", "/ck/a.pt", expected="1 bytes", got="0 bytes")
    assert str(err) == "trainer.resume_from: /ck/a.pt: expected 1 bytes, got 0 bytes"
