"""The page's files: static assets, the manifest, and one script per dump.

The page loads per-step data by adding ``<script src="data/r0/train_000003.js">``
tags, since a browser refuses ``fetch()`` of ``file://`` URLs: each such script calls
``window.__skyrlDump(key, document)`` (or ``(key, null, message)`` for a dump that
cannot be read), so the page works from a plain file with no server and no network,
and reads one step at a time however long the run. ``data/manifest.js`` sets
``window.__skyrlManifest``: the runs, their plotted metrics and their dumps.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import orjson

from skyrl_train.runs.rollouts import DumpRef, RolloutDumpError, read_dump
from skyrl_train.viewer.inputs import PANELS, RunInput, page_document, plotted_series

STATIC = Path(__file__).with_name("static")
MANIFEST = "data/manifest.js"
_SOURCE_NOTE = ".source"  # which run folder a data/rN/ folder was written from


def plotly_js() -> Path:
    """Plotly's bundled ``plotly.min.js`` (the PyPI package's copy; never a CDN)."""
    try:
        import plotly
    except ImportError:
        raise OSError("plotly is not installed (pip install 'plotly>=5')") from None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise OSError(f"{path}: expected Plotly's bundle there, got no such file")
    return path


def asset_files() -> dict[str, Path]:
    """``{url path: file}`` of the page's static files."""
    files = {"index.html": STATIC / "index.html", "assets/plotly.min.js": plotly_js()}
    for path in sorted(STATIC.iterdir()):
        if path.suffix in (".js", ".css"):
            files[f"assets/{path.name}"] = path
    return files


def dump_url(run_index: int, ref: DumpRef) -> str:
    return f"data/r{run_index}/{ref.kind}_{ref.step:06d}.js"


def dump_key(run_index: int, kind: str, step: int) -> str:
    return f"r{run_index}/{kind}/{step}"


def manifest(runs: list[RunInput], *, mode: str) -> dict[str, Any]:
    panels = [
        {"title": title, "series": [{"key": key, "label": label} for key, label in series]}
        for title, series in PANELS
    ]
    return {
        "mode": mode,
        "panels": panels,
        "runs": [
            {
                "id": f"r{i}",
                "name": run.name,
                "path": str(run.path),
                "num_metric_steps": len(run.metrics),
                "metrics": plotted_series(run.metrics),
                "dumps": [
                    {
                        "step": ref.step,
                        "kind": ref.kind,
                        "file": ref.path.name,
                        "url": dump_url(i, ref),
                    }
                    for ref in run.dumps
                ],
                "warnings": run.warnings,
            }
            for i, run in enumerate(runs)
        ],
    }


def manifest_script(runs: list[RunInput], *, mode: str) -> bytes:
    return b"window.__skyrlManifest = " + orjson.dumps(manifest(runs, mode=mode)) + b";\n"


def dump_script(run_index: int, kind: str, step: int, path: Path) -> tuple[bytes, str | None]:
    """The script the page loads for one dump, and the problem with it if any (the
    script then carries the message, naming the file, for the page to show)."""
    key = orjson.dumps(dump_key(run_index, kind, step))
    try:
        document = page_document(read_dump(path), path)
    except RolloutDumpError as exc:
        message = str(exc)
        return b"window.__skyrlDump(" + key + b", null, " + orjson.dumps(message) + b");\n", message
    return b"window.__skyrlDump(" + key + b", " + orjson.dumps(document) + b");\n", None


def _copy_if_changed(source: Path, target: Path) -> None:
    if target.exists():
        old, new = target.stat(), source.stat()
        if old.st_size == new.st_size and old.st_mtime_ns >= new.st_mtime_ns:
            return
    shutil.copyfile(source, target)


def _stamp(path: Path) -> bytes | None:
    """The first line of a dump's script: its dump's size and mtime, so that a later
    write reuses the script only while the dump is the same (None: no such dump)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return f"// from a dump of {stat.st_size} bytes, mtime {stat.st_mtime_ns}\n".encode()


def _still_good(target: Path, stamp: bytes) -> bool:
    if not target.exists():
        return False
    with target.open("rb") as fh:
        return fh.read(len(stamp)) == stamp


def _run_data(out: Path, run_index: int, run: RunInput) -> list[str]:
    """Write ``data/rN/`` for one run, skipping dumps unchanged since the last write
    of this same run folder; returns the warnings about dumps that cannot be read
    (their scripts carry no stamp, so they are read, and warned about, every time)."""
    folder = out / "data" / f"r{run_index}"
    note = folder / _SOURCE_NOTE
    if folder.exists() and (not note.exists() or note.read_text() != str(run.path)):
        shutil.rmtree(folder)  # another run's data: nothing of it can be reused
    folder.mkdir(parents=True, exist_ok=True)
    note.write_text(str(run.path))
    wanted = {dump_url(run_index, ref).rsplit("/", 1)[1]: ref for ref in run.dumps}
    for stale in folder.glob("*.js"):
        if stale.name not in wanted:
            stale.unlink()  # a dump a resume dropped
    warnings = []
    for name, ref in wanted.items():
        target = folder / name
        stamp = _stamp(ref.path)
        if stamp is not None and _still_good(target, stamp):
            continue
        script, problem = dump_script(run_index, ref.kind, ref.step, ref.path)
        if problem:
            warnings.append(problem)
        elif stamp is not None:
            script = stamp + script
        target.write_bytes(script)
    return warnings


def write_site(runs: list[RunInput], out: Path) -> list[str]:
    """Write the page into ``out`` (``index.html`` and what it loads); returns the
    warnings (torn metrics lines, dumps that cannot be read), each naming its file."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "assets").mkdir(exist_ok=True)
    for name, source in asset_files().items():
        _copy_if_changed(source, out / name)
    for i, run in enumerate(runs):
        run.warnings = run.warnings + _run_data(out, i, run)  # the page lists them too
    warnings = [w for run in runs for w in run.warnings]
    for stale in (out / "data").glob("r*"):
        if stale.is_dir() and stale.name[1:].isdigit() and int(stale.name[1:]) >= len(runs):
            shutil.rmtree(stale)
    tmp = out / f"{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_bytes(manifest_script(runs, mode="file"))
    tmp.replace(out / MANIFEST)
    return warnings
