"""The vLLM server's process side without vLLM: the spec, the command line, and the
start/health/stop machinery driven against a fake server (a script standing in for
vLLM's Python, which forks a child into its group as vLLM forks its EngineCore)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inference.errors import CheckpointFormatError, EngineStartError
from inference.vllm.process import (
    INSTALL_SCRIPT,
    PYTHON_KEY,
    VLLMServerProcess,
    VLLMServerSpec,
    default_vllm_python,
    vllm_command,
)
from inference.vllm.transport import BACKEND, WORKER_EXTENSION
from tests.inference.vllm_engine.harness import group_members

REPO = Path(__file__).resolve().parents[3]

FAKE_SERVER = """\
import http.server, json, os, signal, sys, time
args = sys.argv[1:]
port, key = int(args[args.index("--port") + 1]), os.environ["VLLM_API_KEY"]
mode = os.environ.get("FAKE_MODE", "serve")
record = {"argv": args, "cwd": os.getcwd(), "pythonpath": os.environ.get("PYTHONPATH"),
          "dev_mode": os.environ.get("VLLM_SERVER_DEV_MODE"), "extra": os.environ.get("FAKE_EXTRA"), "pgid": os.getpgrp(),
          "offline": [os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE")]}
with open(os.environ["FAKE_RECORD"], "w") as f:
    json.dump(record, f)
print("fake vllm: starting", flush=True)
if mode == "exit":
    print("fake vllm: ValueError: config.json is not a model config", flush=True)
    sys.exit(3)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = os.fork()
if child == 0:  # stands for vLLM's EngineCore: same process group, outlives its parent
    time.sleep(3600)
    os._exit(0)
with open(os.environ["FAKE_RECORD"] + ".child", "w") as f:
    f.write(str(child))
if mode == "hang":
    time.sleep(3600)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        good = self.headers.get("Authorization") == f"Bearer {key}"
        dead = os.path.exists(os.environ["FAKE_RECORD"] + ".dead")  # as vLLM's dead EngineCore
        self.send_response((503 if dead else 200) if self.path == "/health" and good else 401)
        self.end_headers()
    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    script.chmod(0o755)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_RECORD", str(record))

    def make(mode: str = "serve", **options) -> VLLMServerProcess:
        monkeypatch.setenv("FAKE_MODE", mode)
        spec = VLLMServerSpec(checkpoint=str(checkpoint), python=str(script), **options)
        return VLLMServerProcess(spec, stop_grace_s=2.0)

    make.record = record  # type: ignore[attr-defined]
    return make


def test_start_waits_for_health_and_stop_ends_the_whole_group(fake) -> None:
    server = fake(env={"FAKE_EXTRA": "x"}, extra_flags={"max_num_seqs": 8})
    url = server.start()
    try:
        assert url.startswith("http://127.0.0.1:") and server.url == url
        record = json.loads(fake.record.read_text())
        assert record["dev_mode"] == "1" and record["extra"] == "x"
        # Local folders only: a folder vLLM cannot find is never looked up on the hub.
        assert record["offline"] == ["1", "1"]
        assert record["argv"][-2:] == ["--max-num-seqs", "8"]
        # vLLM's workers import the extension from a private folder holding only the
        # four import-free modules, which is also the working directory.
        staged = Path(record["pythonpath"])
        assert record["cwd"] == str(staged)
        files = sorted(str(p.relative_to(staged)) for p in staged.rglob("*.py"))
        assert files == [
            "inference/__init__.py",
            "inference/vllm/__init__.py",
            "inference/vllm/seeded_sampling.py",
            "inference/vllm/transport.py",
            "inference/vllm/worker_extension.py",
        ]
        assert "fake vllm: starting" in server.log_tail()
        pgid = server.pid
        assert pgid is not None and len(group_members(pgid)) == 2  # server and its child
    finally:
        server.stop()
    assert group_members(pgid) == []
    assert not staged.parent.exists()  # the private folder, default log included
    server.stop()  # idempotent
    with pytest.raises(RuntimeError, match="expected a started server"):
        server.url  # noqa: B018


def test_a_random_key_per_start_unless_given(fake) -> None:
    server = fake()
    server.start()
    key = server.api_key
    server.stop()
    server.start()
    try:
        assert server.api_key != key and len(server.api_key) >= 24
    finally:
        server.stop()
    given = fake(api_key="fixed-key")
    given.start()
    try:
        assert given.api_key == "fixed-key"
        # In the environment, not in argv: ps shows every process's argv to every user.
        argv = json.loads(fake.record.read_text())["argv"]
        assert not any("fixed-key" in arg for arg in argv) and "--api-key" not in argv
    finally:
        given.stop()


def test_sigkill_after_the_grace_period_for_a_group_that_ignores_sigterm(fake) -> None:
    server = fake("stubborn")
    server.start()
    pgid = server.pid
    assert pgid is not None
    start = time.monotonic()
    server.stop()
    assert group_members(pgid) == []
    assert 1.5 < time.monotonic() - start < 10


def test_stop_after_the_server_was_killed_from_outside_ends_its_children(fake) -> None:
    server = fake()
    server.start()
    pgid = server.pid
    assert pgid is not None
    child = int(Path(str(fake.record) + ".child").read_text())
    os.kill(pgid, signal.SIGKILL)  # the leader dies; its child lives on in the group
    time.sleep(0.3)
    assert child in group_members(pgid)
    server.stop()
    assert group_members(pgid) == []


def test_interpreter_exit_stops_a_server_left_running(fake, tmp_path: Path) -> None:
    script = tmp_path / "fake-python"  # the fixture wrote it, and the checkpoint folder
    program = (
        "import sys; from inference.vllm.process import VLLMServerProcess, VLLMServerSpec; "
        f"s = VLLMServerProcess(VLLMServerSpec(checkpoint={str(tmp_path / 'ckpt')!r}, "
        f"python={str(script)!r})); s.start(); print(s.pid)"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    pgid = int(done.stdout.split()[-1])
    assert group_members(pgid) == []


def test_a_server_that_exits_raises_with_its_log_lines(fake) -> None:
    server = fake("exit")
    start = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        server.start()
    assert time.monotonic() - start < 10
    err = info.value
    assert "exited with code 3" in str(err)
    assert "config.json is not a model config" in err.log_tail
    assert "config.json is not a model config" in str(err)
    assert err.log_path == str(server.log_path)
    log = Path(err.log_path)
    assert log.is_file()  # kept: the error names it
    shutil.rmtree(log.parent)


def test_a_server_that_never_answers_raises_at_the_deadline_and_is_stopped(fake) -> None:
    server = fake("hang", startup_timeout_s=1.5, log_file=str(fake.record.with_name("hang.log")))
    start = time.monotonic()
    with pytest.raises(EngineStartError, match=r"no 200 from /health within 1.5 s") as info:
        server.start()
    assert time.monotonic() - start < 8
    assert "fake vllm: starting" in info.value.log_tail
    pgid = json.loads(fake.record.read_text())["pgid"]
    assert group_members(pgid) == []  # its child included


def test_a_log_file_can_be_named(fake, tmp_path: Path) -> None:
    server = fake("exit", log_file=str(tmp_path / "logs" / "vllm.log"))
    with pytest.raises(EngineStartError):
        server.start()
    assert "fake vllm: starting" in (tmp_path / "logs" / "vllm.log").read_text()


def test_a_missing_checkpoint_folder_fails_before_launch(fake, tmp_path: Path) -> None:
    spec = VLLMServerSpec(checkpoint=str(tmp_path / "absent"), python=sys.executable)
    with pytest.raises(CheckpointFormatError) as info:
        VLLMServerProcess(spec).start()
    assert str(info.value).startswith("folder: expected an existing checkpoint folder")
    assert f"{tmp_path / 'absent'}: not found" in str(info.value)


def test_a_relative_checkpoint_reaches_vllm_as_an_absolute_path(
    fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM runs in its staging folder: a relative --model would name nothing there.
    monkeypatch.chdir(tmp_path)
    server = fake()
    server = VLLMServerProcess(dataclasses.replace(server.spec, checkpoint="ckpt"))
    server.start()
    try:
        argv = json.loads(fake.record.read_text())["argv"]
        assert argv[argv.index("--model") + 1] == str(tmp_path / "ckpt")
    finally:
        server.stop()


def test_failure_names_an_exit_or_a_health_that_is_not_200(fake) -> None:
    server = fake()
    assert server.failure() is None  # not started
    server.start()
    try:
        assert server.failure() is None
        Path(str(fake.record) + ".dead").touch()
        assert server.failure() == "its /health answered 503 (vLLM's engine died)"
        os.kill(server.pid or 0, signal.SIGKILL)
        server._proc.wait()  # type: ignore[union-attr]
        assert server.failure() == "the vLLM server exited with code -9"
    finally:
        server.stop()
    assert server.failure() is None


def test_a_python_that_is_not_executable_is_refused(tmp_path: Path) -> None:
    spec = VLLMServerSpec(checkpoint=str(tmp_path), python=str(tmp_path / "no-python"))
    with pytest.raises(FileNotFoundError, match=PYTHON_KEY):
        VLLMServerProcess(spec).start()


def test_default_python_names_the_key_and_the_install_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYRL_R3_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        default_vllm_python()
    assert PYTHON_KEY in str(info.value) and INSTALL_SCRIPT in str(info.value)
    assert str(tmp_path / "vllm-venv" / "bin" / "python") in str(info.value)
    python = tmp_path / "vllm-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert default_vllm_python() == str(python)


def test_command_line() -> None:
    spec = VLLMServerSpec(
        checkpoint="/ckpt",
        dtype="float32",
        kv_cache_memory_bytes=1 << 20,
        extra_flags={
            "max_num_seqs": 4,
            "enable-prefix-caching": False,
            "enable_chunked_prefill": True,
            "compilation_config": {"level": 0},
            "middleware": ["a.b", "c.d"],
        },
    )
    argv = vllm_command(spec, python="/py", port=1234)
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(argv)
    for part in (
        "--model /ckpt",
        "--skip-tokenizer-init",
        "--dtype float32",
        "--enable-scale-out",
        "--enforce-eager",
        "--host 127.0.0.1 --port 1234",
        "--logprobs-mode processed_logprobs",
        f"--worker-extension-cls {WORKER_EXTENSION}",
        "--kv-cache-memory-bytes 1048576",
        "--max-num-seqs 4",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--middleware a.b c.d",
    ):
        assert part in text, part
    config = argv[argv.index("--weight-transfer-config") + 1]
    assert json.loads(config) == {"backend": BACKEND}
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"level": 0}
    eager = vllm_command(VLLMServerSpec(checkpoint="/c", enforce_eager=False), python="/py", port=1)
    assert "--enforce-eager" not in eager


def test_the_api_key_stays_out_of_the_repr() -> None:
    assert "secret-key" not in repr(VLLMServerSpec(checkpoint="/c", api_key="secret-key"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"checkpoint": ""}, "VLLMServerSpec.checkpoint: expected a folder path"),
        (
            {"port": 70000},
            r"VLLMServerSpec.port: expected 0 \(pick a free one\) or 1..65535, got 70000",
        ),
        ({"port": True}, "VLLMServerSpec.port"),
        ({"dtype": "fp8"}, "VLLMServerSpec.dtype: expected one of"),
        (
            {"kv_cache_memory_bytes": 0},
            "VLLMServerSpec.kv_cache_memory_bytes: expected None or a positive int",
        ),
        ({"startup_timeout_s": 0}, "VLLMServerSpec.startup_timeout_s: expected a positive number"),
        ({"api_key": ""}, "VLLMServerSpec.api_key: expected None or a non-empty string"),
        (
            {"extra_flags": {"port": 1}},
            r"extra_flags\['port'\]: expected a flag the launcher does not set",
        ),
        ({"extra_flags": {"no_enforce_eager": True}}, "expected a flag the launcher does not set"),
        ({"extra_flags": {"--max-num-seqs": 1}}, "extra_flags: expected option names"),
        ({"extra_flags": {"seed": None}}, r"extra_flags\['seed'\]: expected a bool, number"),
        ({"extra_flags": {"x": []}}, r"extra_flags\['x'\]: expected a non-empty list"),
        ({"env": {"A": 1}}, "VLLMServerSpec.env: expected str -> str"),
    ],
)
def test_bad_specs_fail_loudly(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VLLMServerSpec(**{"checkpoint": "/c", **options})


@pytest.mark.slow
def test_the_ray_actor_starts_reports_and_stops_the_server(fake, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from inference.vllm.actor import create_vllm_server_actor
    from skyrl_train.utils.ray_session import start_ray

    spec = VLLMServerSpec(
        checkpoint=str(tmp_path / "ckpt"),
        python=str(tmp_path / "fake-python"),  # the fixture wrote it
        api_key="actor-key",
        env={"FAKE_RECORD": str(fake.record), "FAKE_MODE": "serve"},
    )
    session = start_ray(address=None, num_cpus=2, runtime_env={})
    try:
        handle, url, api_key = create_vllm_server_actor(spec, num_cpus=1)
        try:
            assert url.startswith("http://127.0.0.1:") and api_key == "actor-key"
            assert ray.get(handle.url.remote()) == url
            assert "fake vllm: starting" in ray.get(handle.log_tail.remote())
            pgid = json.loads(fake.record.read_text())["pgid"]
            assert len(group_members(pgid)) == 2
        finally:
            ray.get(handle.stop.remote())
        assert group_members(pgid) == []
        with pytest.raises(ray.exceptions.RayTaskError, match="expected a started actor"):
            ray.get(handle.url.remote())
        ray.kill(handle)
    finally:
        session.shutdown()
