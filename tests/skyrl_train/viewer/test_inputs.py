"""The viewer without a browser: what the command writes and refuses, and what the
server answers (the page itself is tested in ``test_browser.py``)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from skyrl_train.entrypoints.view import main
from skyrl_train.runs.rollouts import dump_path, write_dump
from skyrl_train.viewer.inputs import PANELS, RUN_MARKER, read_metrics_tolerant
from skyrl_train.viewer.serve import make_server
from skyrl_train.viewer.site import dump_script
from skyrl_train.viewer.synthetic import make_run, step_document


def manifest_of(out: Path) -> dict:
    text = (out / "data" / "manifest.js").read_text()
    return json.loads(text.removeprefix("window.__skyrlManifest = ").rstrip().rstrip(";"))


def test_the_marker_is_the_run_folders() -> None:
    from skyrl_train.runs.folder import MARKER_FILE

    assert RUN_MARKER == MARKER_FILE


def test_the_page_is_written_offline_with_only_the_plotted_keys(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run_a", steps=12, dump_every=3)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 13, "reward/mean": 0.5, "secret/other": 1}) + "\n")
    assert main([str(run)]) == 0
    out = run / "view"
    assert capsys.readouterr().out.strip() == str(out.resolve() / "index.html")
    html = (out / "index.html").read_text()
    sources = re.findall(r"<script[^>]*src=\"([^\"]+)\"", html)
    assert sources and not [s for s in sources if re.match(r"(?i)(https?:)?//", s)]
    for source in sources:
        assert (out / source).is_file(), source
    for script in (out / "assets").glob("*.js"):
        if script.name != "plotly.min.js":
            assert not re.search(r"https?://", script.read_text()), script
    manifest = manifest_of(out)
    (only,) = manifest["runs"]
    plotted = {key for _title, series in PANELS for key, _label in series}
    assert set(only["metrics"]) <= plotted and "reward/mean" in only["metrics"]
    assert only["num_metric_steps"] == 13 and len(only["metrics"]["reward/mean"][0]) == 13
    steps = [(d["kind"], d["step"]) for d in only["dumps"]]
    assert steps == [
        ("train", 1),
        ("train", 3),
        ("train", 6),
        ("train", 9),
        ("eval", 10),
        ("train", 12),
    ]
    script = (out / "data" / "r0" / "train_000003.js").read_text()
    assert script.splitlines()[1].startswith('window.__skyrlDump("r0/train/3", {')
    assert "prompt_ids" not in script  # the page shows the prompt's text


def test_a_rewrite_reuses_unchanged_dumps_and_drops_removed_ones(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=4)
    assert main([str(run), "--out", str(tmp_path / "page")]) == 0
    data = tmp_path / "page" / "data" / "r0"
    kept = (data / "train_000002.js").stat().st_mtime_ns
    dump_path(run, 4, "train").unlink()
    assert main([str(run), "--out", str(tmp_path / "page")]) == 0
    assert (data / "train_000002.js").stat().st_mtime_ns == kept
    assert not (data / "train_000004.js").exists()
    before = (data / "train_000001.js").read_text()
    write_dump(run, step_document(1, seed=7))  # a resumed run re-took step 1
    assert main([str(run), "--out", str(tmp_path / "page")]) == 0
    assert (data / "train_000001.js").read_text() != before
    other = make_run(tmp_path / "other", steps=2, seed=1)
    assert main([str(other), "--out", str(tmp_path / "page")]) == 0
    assert sorted(p.name for p in data.glob("*.js")) == ["train_000001.js", "train_000002.js"]
    assert '"other"' in (tmp_path / "page" / "data" / "manifest.js").read_text()


@pytest.mark.parametrize(
    ("make", "got"),
    [
        (lambda p: p, "got no such file or folder"),
        (lambda p: (p.mkdir(), p)[1], "got a folder holding nothing"),
        (
            lambda p: (p.mkdir(), (p / "notes.txt").write_text("x"), p)[2],
            "got a folder holding notes.txt",
        ),
        (lambda p: (p.write_text("x"), p)[1], "got a file"),
    ],
)
def test_a_folder_that_is_not_a_run_exits_2_naming_it(tmp_path: Path, capsys, make, got) -> None:
    path = make(tmp_path / "not_a_run")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"view: {path}: expected a run folder (run.json, metrics.jsonl or rollouts/), {got}\n"
    )


def test_a_torn_last_metrics_line_is_skipped_with_a_warning(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run", steps=3)
    with (run / "metrics.jsonl").open("ab") as fh:
        fh.write(b'{"step": 4, "reward/mea')
    rows, warnings = read_metrics_tolerant(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert warnings == [f"{run / 'metrics.jsonl'}:4: skipped a torn last line"]
    assert main([str(run)]) == 0
    assert (
        f"view: warning: {run / 'metrics.jsonl'}:4: skipped a torn last line"
        in capsys.readouterr().err
    )
    assert manifest_of(run / "view")["runs"][0]["warnings"] == warnings


def test_unreadable_dumps_become_messages_naming_the_file(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run", steps=4)
    torn = dump_path(run, 2, "train")
    torn.write_bytes(torn.read_bytes()[:50])
    old = dump_path(run, 3, "train")
    document = orjson.loads(gzip.decompress(old.read_bytes()))
    old.write_bytes(gzip.compress(orjson.dumps({**document, "version": 0})))
    short = step_document(4)
    short["trajectories"][1]["advantages"].pop()
    write_dump(run, short)
    assert main([str(run)]) == 0
    err = capsys.readouterr().err
    assert f"view: warning: {torn}: expected a whole gzip file, got a torn one" in err
    assert f"view: warning: {old}: expected version 1" in err and "older format" in err
    assert (
        f"view: warning: {dump_path(run, 4, 'train')}: trajectories[1].advantages: "
        "expected one per response token" in err
    )
    script = (run / "view" / "data" / "r0" / "train_000002.js").read_text()
    assert script.startswith('window.__skyrlDump("r0/train/2", null, ') and str(torn) in script
    _script, problem = dump_script(0, "train", 9, dump_path(run, 9, "train"))
    assert problem == f"{dump_path(run, 9, 'train')}: expected a rollout dump, got no such file"


def test_serving_answers_on_loopback_only(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=3)
    with pytest.raises(ValueError, match=r"--host: expected 127.0.0.1 .*, got '0.0.0.0'"):
        make_server([run], host="0.0.0.0")
    server = make_server([run], port=0)
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    import threading

    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}/"
        assert b"skyrl-r3 run viewer" in urllib.request.urlopen(base).read()
        body = urllib.request.urlopen(base + "data/r0/train_000002.js").read()
        assert body.startswith(b'window.__skyrlDump("r0/train/2", {')
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(base + "../run.json")
        assert not (run / "view").exists()  # serving writes nothing
    finally:
        server.shutdown()
        server.server_close()


def test_the_command_refuses_a_host_that_is_not_loopback(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=1)
    result = subprocess.run(
        [sys.executable, "-m", "skyrl_train.entrypoints.view", str(run), "--serve", "--host", "0.0.0.0"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        "view: --host: expected 127.0.0.1 (the viewer serves this machine only), got '0.0.0.0'\n"
    )


def test_without_chromium_the_browser_tests_skip_unless_ci_requires_them(monkeypatch) -> None:
    from tests.skyrl_train.viewer import _browser

    monkeypatch.setattr(_browser.shutil, "which", lambda name: None)
    monkeypatch.delenv("SKYRL_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no chromium on PATH"):
        _browser.chromium_or_skip()
    monkeypatch.setenv("SKYRL_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="SKYRL_REQUIRE_BROWSER is set but no chromium"):
        _browser.chromium_or_skip()


def test_the_command_loads_no_torch() -> None:
    """The viewer reads files; it opens in a fraction of a second, with no torch."""
    code = "import sys, skyrl_train.entrypoints.view; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
