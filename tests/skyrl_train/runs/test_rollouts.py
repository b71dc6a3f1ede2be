"""Rollout dump files: round trip, atomic writes, clear refusals, resume and branch."""

from __future__ import annotations

import gzip
import os
import re
from pathlib import Path

import orjson
import pytest

from skyrl_train.runs.rollouts import (
    FORMAT,
    ROLLOUTS_DIR,
    VERSION,
    RolloutDumpError,
    drop_dumps_after,
    dump_path,
    list_dumps,
    read_dump,
    write_dump,
)


def document(step: int, kind: str = "train", **more) -> dict:
    trajectory = {"index": 0, "response_ids": [65, 66], "tokens": ["A", "B"], "reward": 0.5}
    return {"step": step, "kind": kind, "trajectories": [trajectory], **more}


def test_a_dump_round_trips_and_names_its_step_and_kind(tmp_path: Path) -> None:
    path = write_dump(tmp_path, document(3, expert_load=[[1, 2], [3, 0]]))
    assert path == tmp_path / ROLLOUTS_DIR / "step_000003.json.gz"
    got = read_dump(path)
    assert (got["format"], got["version"], got["step"], got["kind"]) == (
        FORMAT,
        VERSION,
        3,
        "train",
    )
    assert got["trajectories"][0]["tokens"] == ["A", "B"] and got["expert_load"] == [[1, 2], [3, 0]]
    assert dump_path(tmp_path, 10, "eval").name == "eval_000010.json.gz"
    with pytest.raises(ValueError, match="kind: expected one of"):
        dump_path(tmp_path, 1, "test")


def test_writes_are_atomic_and_repeatable(tmp_path: Path, monkeypatch) -> None:
    first = write_dump(tmp_path, document(1)).read_bytes()
    # The same step written again (a resumed run) gives the same bytes, in place.
    assert write_dump(tmp_path, document(1)).read_bytes() == first
    assert sorted(p.name for p in (tmp_path / ROLLOUTS_DIR).iterdir()) == ["step_000001.json.gz"]
    # A write killed before its rename leaves the old file whole, and only a .tmp- file.
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError, match="killed"):
        write_dump(tmp_path, document(1, extra="new"))
    monkeypatch.undo()
    assert read_dump(dump_path(tmp_path, 1, "train")).get("extra") is None
    leftovers = [p for p in (tmp_path / ROLLOUTS_DIR).iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1
    assert [ref.step for ref in list_dumps(tmp_path)] == [1]  # the torn write is no dump
    assert drop_dumps_after(tmp_path, 1) == 1 and not leftovers[0].exists()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"not gzip at all", "expected a whole gzip file, got a torn one"),
        (gzip.compress(b'{"format": "skyrl-r3/rollouts", "vers')[:-6], "torn"),
        (gzip.compress(b'{"format": "skyrl-r3/rollouts", "vers'), "expected JSON"),
        (
            gzip.compress(b'{"format": "other", "version": 1}'),
            "expected format 'skyrl-r3/rollouts'",
        ),
        (gzip.compress(b"[1, 2]"), "got 'list'"),
        (
            gzip.compress(orjson.dumps({"format": FORMAT, "version": 0, "trajectories": []})),
            "expected version 1, got 0: an older format",
        ),
        (
            gzip.compress(orjson.dumps({"format": FORMAT, "version": 7, "trajectories": []})),
            "got 7: written by a newer skyrl-r3",
        ),
        (gzip.compress(orjson.dumps({"format": FORMAT, "version": 1})), "'trajectories' list"),
    ],
    ids=[
        "not_gzip",
        "torn_gzip",
        "torn_json",
        "other_format",
        "not_object",
        "older",
        "newer",
        "no_rows",
    ],
)
def test_a_bad_dump_is_refused_naming_the_file(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    path = tmp_path / "step_000002.json.gz"
    path.write_bytes(content)
    with pytest.raises(RolloutDumpError, match=re.escape(problem)) as caught:
        read_dump(path)
    assert caught.value.file == path and str(caught.value).startswith(f"{path}: ")


def test_a_missing_dump_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(RolloutDumpError, match="no such file"):
        read_dump(tmp_path / "rollouts" / "step_000009.json.gz")


def test_listing_orders_steps_train_before_eval_and_skips_strangers(tmp_path: Path) -> None:
    for step, kind in [(10, "eval"), (2, "train"), (10, "train"), (1, "train")]:
        write_dump(tmp_path, document(step, kind))
    (tmp_path / ROLLOUTS_DIR / "notes.txt").write_text("mine")
    refs = list_dumps(tmp_path)
    assert [(r.step, r.kind) for r in refs] == [
        (1, "train"),
        (2, "train"),
        (10, "train"),
        (10, "eval"),
    ]
    assert list_dumps(tmp_path / "nowhere") == []


def test_a_resume_or_a_branch_drops_the_later_dumps(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        write_dump(tmp_path, document(step))
    write_dump(tmp_path, document(4, "eval"))
    assert drop_dumps_after(tmp_path, 2) == 3
    assert [(r.step, r.kind) for r in list_dumps(tmp_path)] == [(1, "train"), (2, "train")]
    assert (tmp_path / ROLLOUTS_DIR / "step_000002.json.gz").is_file()
    assert drop_dumps_after(tmp_path / "empty", 0) == 0
