"""Crash-safe checkpoint folders: written aside, fsynced, renamed into place, verified.

Layout under ``<run_dir>/checkpoints`` (a checkpoint folder is flat)::

    step_000010/                 complete: a step_* folder only ever appears whole
        policy_rank0.pt          one file per trainer rank (PolicyTrainer.save_checkpoint)
        policy_rank1.pt
        driver.json              {"step": 10, "world_size": 2}
        run_config.json          model and trainer layout, to rebuild the ranks (export)
        manifest.json            written last; names, sizes and SHA-256 of the others
    step_000020.tmp-1a2b3c4d/    a save in progress, or one a crash cut short: never
                                 resumed from, removed by the next save

A save is ``begin_save`` (fresh temp folder), each rank and the driver writing their
files with ``utils.durable.write_file`` (fsynced), then ``commit_save``: manifest, fsync of the
folder, ``rename`` to ``step_NNNNNN`` (atomic within one filesystem) and fsync of the
parent. A crash at any point leaves the previous checkpoints and at most a temp folder.

``verify_checkpoint`` checks a folder against its manifest (file set, sizes, SHA-256)
with the standard library only, so a launch refuses a damaged ``trainer.resume_from``
in seconds, before Ray starts; every refusal is one ``CheckpointError`` naming the
file, what was expected and what was found.

The manifest a save writes last is exactly what verify_checkpoint reads. What the rank
files inside mean is the tower above this module, which imports none of it:
``rank_file``, ``reshard`` and ``resume`` (docs/design.md, "A rank's checkpoint").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_train.errors import CheckpointError
from skyrl_train.utils.durable import fsync_dir, rename_into_place, temp_sibling, write_file

FORMAT = "skyrl-r3-checkpoint"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
DRIVER_FILE = "driver.json"
RUN_CONFIG_FILE = "run_config.json"
"""Written by the policy group: the config sections that rebuild its ranks
(``trainer.policy_group.run_config_record``), read by ``scripts/export_hf.py``."""
RESUME_KEY = "trainer.resume_from"
STEP_DIR = re.compile(r"step_(\d+)")
TEMP_DIR = re.compile(r"step_\d+\.tmp-[0-9a-f]+")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint, as the manifest lists it."""

    name: str
    """Relative to the checkpoint folder (a plain file name: the folder is flat)."""
    size: int
    sha256: str


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder whose files matched its manifest."""

    folder: Path
    step: int
    world_size: int
    """Trainer ranks that wrote it (``trainer.placement.num_trainers`` to resume)."""
    files: tuple[FileRecord, ...]


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


# ---------------------------------------------------------------------------- saving


def begin_save(root: Path, *, step: int) -> Path:
    """A fresh temp folder for step ``step``'s files; removes temp folders that
    earlier saves left (one run writes to a run_dir at a time, so none is live)."""
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_saves(root)
    folder = temp_sibling(root / checkpoint_name(step))
    folder.mkdir()
    return folder


def commit_save(folder: Path, *, step: int) -> Path:
    """Write the manifest of ``folder`` (a ``begin_save`` folder whose files are all
    written) and rename it to ``step_NNNNNN``; returns the committed folder.

    A checkpoint of the same step already there (a resumed run re-taking a step) is
    first renamed aside as a temp folder, so a crash between the two renames leaves
    a temp folder, not a broken ``step_*``. A ``step_*`` folder that is not a
    checkpoint (no manifest: an older save, or the user's) is kept, renamed
    ``step_NNNNNN.replaced-*``.
    """
    if not TEMP_DIR.fullmatch(folder.name):
        raise ValueError(f"folder: expected a begin_save temp folder, got {str(folder)!r}")
    records = []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.is_symlink():
            raise ValueError(f"{path}: expected a regular file in a flat checkpoint folder")
        records.append(_record(path))
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "files": [{"name": r.name, "size": r.size, "sha256": r.sha256} for r in records],
    }
    write_file(folder / MANIFEST_FILE, json.dumps(manifest, indent=1).encode() + b"\n")
    fsync_dir(folder)
    final = folder.parent / checkpoint_name(step)
    aside, ours = None, False
    if final.exists():
        try:
            verify_checkpoint(final, hash_files=False)
            aside, ours = temp_sibling(final), True
        except CheckpointError:
            aside = final.with_name(f"{final.name}.replaced-{secrets.token_hex(4)}")
    rename_into_place(folder, final, aside=aside)
    if aside is not None and ours:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def remove_stale_saves(root: Path) -> list[Path]:
    """Remove ``step_*.tmp-*`` folders under ``root``; returns what was removed."""
    stale = [p for p in sorted(root.iterdir()) if p.is_dir() and TEMP_DIR.fullmatch(p.name)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def prune_checkpoints(root: Path, *, keep: int | None, current_step: int) -> list[Path]:
    """Delete the oldest checkpoints beyond ``keep`` (None or -1: keep all); returns
    the deleted folders.

    Only ``list_checkpoints``'s folders count; anything else under ``root`` is never
    touched. ``current_step``'s, the one just written, is always kept. Oldest means
    earliest in this run's history: checkpoints with a higher step are not this run's
    (a launch resuming below them deletes them as it is accepted, ``runs.claim``; only
    one made by hand meanwhile is left), so they go first, then the lowest steps.
    """
    if keep is None or keep < 0:
        return []
    current = root / checkpoint_name(current_step)
    others = [c for c in list_checkpoints(root) if c.folder != current]
    earlier = sorted((c for c in others if c.step < current_step), key=lambda c: -c.step)
    kept = {c.folder for c in earlier[: max(keep - 1, 0)]}
    removed = []
    for found in others:
        if found.folder not in kept:
            # Renamed first: a crash mid-delete leaves a temp folder, not a step_*
            # folder with files missing.
            aside = temp_sibling(found.folder)
            os.rename(found.folder, aside)
            shutil.rmtree(aside, ignore_errors=True)
            removed.append(found.folder)
    if removed:
        fsync_dir(root)
    return removed


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """The checkpoints under ``root`` that saving and pruning may replace or delete,
    by step: folders named ``step_NNNNNN`` (no symlinks) whose manifest and file sizes
    check out (SHA-256 is not re-read) and whose manifest step matches the name.
    Anything else is not provably a checkpoint of this run: the user decides."""
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        match = STEP_DIR.fullmatch(path.name)
        if not match or path.is_symlink() or not path.is_dir():
            continue
        try:
            checkpoint = verify_checkpoint(path, hash_files=False)
        except CheckpointError:
            continue
        if checkpoint.step == int(match.group(1)):
            found.append(checkpoint)
    return sorted(found, key=lambda c: c.step)


# ------------------------------------------------------------------------- verifying


def verify_checkpoint(
    folder: str | Path, *, key: str = RESUME_KEY, hash_files: bool = True
) -> Checkpoint:
    """Check ``folder`` against its manifest; raises ``CheckpointError`` naming ``key``
    and the first bad file. ``hash_files=False`` skips the SHA-256 pass (sizes and the
    file set are still checked), for callers that verified the folder already."""
    folder = Path(folder)
    if TEMP_DIR.fullmatch(folder.name):
        raise CheckpointError(
            key,
            folder,
            expected="a committed checkpoint folder (step_NNNNNN)",
            got="the temp folder of a save that never finished",
        )
    if not folder.is_dir():
        raise CheckpointError(key, folder, expected="a checkpoint folder", got="no such folder")
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(
            key,
            manifest_path,
            expected="the manifest every complete save writes last",
            got="no such file (an unfinished save, or one from before manifests)",
        )
    manifest = _read_json_object(manifest_path, key)
    step, records = _parse_manifest(manifest, manifest_path, key)
    listed = {r.name: r for r in records}
    present = {p.name for p in folder.iterdir() if p.name != MANIFEST_FILE}
    missing, extra = sorted(listed.keys() - present), sorted(present - listed.keys())
    if missing:
        raise CheckpointError(
            key,
            folder / missing[0],
            expected=f"a file of {listed[missing[0]].size} bytes listed in {MANIFEST_FILE}",
            got="no such file",
        )
    if extra:
        raise CheckpointError(
            key,
            folder / extra[0],
            expected=f"only the files {MANIFEST_FILE} lists {sorted(listed)}",
            got="an extra file",
        )
    for record in records:
        path = folder / record.name
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(key, path, expected="a regular file", got="something else")
        size = path.stat().st_size
        if size != record.size:
            raise CheckpointError(
                key,
                path,
                expected=f"{record.size} bytes",
                got=f"{size} bytes (truncated, half-written or replaced)",
            )
    if hash_files:
        for record in records:
            digest = _sha256(folder / record.name)
            if digest != record.sha256:
                raise CheckpointError(
                    key,
                    folder / record.name,
                    expected=f"sha256 {record.sha256}",
                    got=f"sha256 {digest} (its bytes changed after the save)",
                )
    if DRIVER_FILE not in listed:
        raise CheckpointError(
            key,
            folder / DRIVER_FILE,
            expected=f"{DRIVER_FILE} listed in {MANIFEST_FILE}",
            got="no entry",
        )
    driver_path = folder / DRIVER_FILE
    driver = _read_json_object(driver_path, key)
    driver_step = _int_field(driver, "step", driver_path, key)
    if driver_step != step:
        raise CheckpointError(
            key, driver_path, expected=f"step {step} as in {MANIFEST_FILE}", got=f"{driver_step}"
        )
    world_size = _int_field(driver, "world_size", driver_path, key)
    return Checkpoint(folder=folder, step=step, world_size=world_size, files=records)


def newest_checkpoint(
    root: Path, *, key: str = RESUME_KEY
) -> tuple[Checkpoint | None, list[tuple[Path, CheckpointError]]]:
    """The highest ``step_NNNNNN`` under ``root`` whose files verify in full (SHA-256),
    and each higher folder that did not, with the ``CheckpointError`` naming its file.

    Temp folders of unfinished saves are not candidates (``TEMP_DIR``); a folder whose
    manifest names another step than its own name is skipped like a damaged one.
    """
    if not root.is_dir():
        return None, []
    candidates = []
    for path in root.iterdir():
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            candidates.append((int(match.group(1)), path))
    skipped: list[tuple[Path, CheckpointError]] = []
    for step, path in sorted(candidates, reverse=True):
        try:
            found = verify_checkpoint(path, key=key)
        except CheckpointError as exc:
            skipped.append((path, exc))
            continue
        if found.step != step:
            mismatch = CheckpointError(
                key,
                path / MANIFEST_FILE,
                expected=f"step {step} as the folder is named",
                got=f"step {found.step}",
            )
            skipped.append((path, mismatch))
            continue
        return found, skipped
    return None, skipped


# --------------------------------------------------------------------------- helpers


def _record(path: Path) -> FileRecord:
    return FileRecord(name=path.name, size=path.stat().st_size, sha256=_sha256(path))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read_json_object(path: Path, key: str) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(
            key, path, expected="a readable JSON file", got=f"{type(exc).__name__}: {exc}"
        ) from exc
    if not raw.strip():
        raise CheckpointError(key, path, expected="a JSON object", got="an empty file")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            key,
            path,
            expected="a JSON object",
            got=f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
        ) from exc
    except ValueError as exc:  # bytes that are not UTF-8
        raise CheckpointError(key, path, expected="a JSON object", got=str(exc)) from exc
    if not isinstance(value, dict):
        raise CheckpointError(
            key, path, expected="a JSON object", got=f"a JSON {type(value).__name__}"
        )
    return value


def _int_field(obj: dict[str, Any], name: str, path: Path, key: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(
            key, path, expected=f"{name!r}: an int >= 0", got=f"{name!r}: {value!r}"
        )
    return value


def _parse_manifest(
    manifest: dict[str, Any], path: Path, key: str
) -> tuple[int, tuple[FileRecord, ...]]:
    fmt, version = manifest.get("format"), manifest.get("format_version")
    if fmt != FORMAT or version != FORMAT_VERSION:
        raise CheckpointError(
            key,
            path,
            expected=f"format {FORMAT!r} version {FORMAT_VERSION}",
            got=f"format {fmt!r} version {version!r}",
        )
    step = _int_field(manifest, "step", path, key)
    files = manifest.get("files")
    if not isinstance(files, list):
        raise CheckpointError(key, path, expected="'files': a list", got=f"'files': {files!r}")
    records = []
    for i, entry in enumerate(files):
        where = f"files[{i}]"
        if not isinstance(entry, dict):
            raise CheckpointError(key, path, expected=f"{where}: an object", got=repr(entry))
        name, size, sha = entry.get("name"), entry.get("size"), entry.get("sha256")
        # A plain name only: a manifest must not make the verifier read outside the folder.
        if not isinstance(name, str) or name in ("", ".", "..", MANIFEST_FILE) or "/" in name:
            raise CheckpointError(key, path, expected=f"{where}.name: a file name", got=f"{name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointError(key, path, expected=f"{where}.size: an int >= 0", got=f"{size!r}")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise CheckpointError(
                key, path, expected=f"{where}.sha256: 64 hex digits", got=f"{sha!r}"
            )
        records.append(FileRecord(name=name, size=size, sha256=sha))
    if len({r.name for r in records}) != len(records):
        raise CheckpointError(key, path, expected="each file listed once", got="duplicates")
    return step, tuple(records)
