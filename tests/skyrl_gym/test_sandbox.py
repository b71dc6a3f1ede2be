"""The sandbox against hostile programs: each ends within its limits, says how it
ended, changes nothing outside its directory and leaves no process or file behind."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from skyrl_gym.error import SandboxError
from skyrl_gym.sandbox import Isolation, SandboxLimits, isolation, run_python, runner

LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1, memory_bytes=256 << 20, output_bytes=64 << 10)


def sandbox_processes(marker: str) -> list[int]:
    """Live processes started by a sandbox run (they carry the marker variable)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if f"{marker}=".encode() in environ:
                found.append(int(entry))
    return found


@pytest.fixture
def leaves_nothing(monkeypatch):
    """This test's runs get their own marker and temp root (other processes on the host
    may use the sandbox meanwhile); afterwards neither a process nor a file remains."""
    marker = f"SKYRL_SANDBOX_TEST_{os.getpid()}_{time.monotonic_ns()}"
    monkeypatch.setattr(runner, "MARKER", marker)
    base = tempfile.mkdtemp(prefix="skyrl-sandbox-test-")
    os.chmod(base, 0o711)  # the program may run as another uid: it must reach its dir
    monkeypatch.setattr(tempfile, "tempdir", base)
    yield
    try:
        assert sandbox_processes(marker) == []
        assert os.listdir(base) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def secret_dir(tmp_path: Path) -> Path:
    secret = tmp_path / "run" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("s3cret-token")
    return secret.parent


def _hostile(secret_dir: Path, target: Path, port: int) -> dict[str, str]:
    return {
        "sleep_loop": "import time\nwhile True:\n    time.sleep(0.1)",
        "busy_loop": "while True:\n    pass",
        "fork_bomb": "import os\nwhile True:\n    os.fork()",
        "alloc_100gb": "x = bytearray(100 * 2**30)\nprint(len(x))",
        "read_secret": f"print(open({str(secret_dir / 'secret.txt')!r}).read())",
        "read_ssh": (
            f"print(open({os.path.join(os.path.expanduser('~'), '.ssh', 'id_rsa')!r}).read())"
        ),
        "write_outside": f"open({str(target)!r}, 'w').write('changed')",
        "socket": f"import socket\ns = socket.create_connection(('127.0.0.1', {port}))\ns.send(b'hi')",
        "print_1gb": "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)",
        "subprocess": "import subprocess\nsubprocess.run(['sleep', '100'])",
        "os_system": f"import os\nos.system('echo changed > {target}')",
        "double_fork": (
            "import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(1000)\n"
            "    os._exit(0)\n"
            "time.sleep(1000)"
        ),
    }


EXPECTED = {
    "sleep_loop": {"timeout"},
    "busy_loop": {"timeout"},
    "alloc_100gb": {"memory"},
    "print_1gb": {"output_limit"},
}
HOSTILE = list(_hostile(Path("/x"), Path("/x"), 1))


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_program_is_contained(name, secret_dir, tmp_path, leaves_nothing):
    target = tmp_path / "outside.txt"
    target.write_text("original")
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    code = _hostile(secret_dir, target, server.getsockname()[1])[name]
    started = time.monotonic()
    try:
        result = run_python(code, limits=LIMITS, deny_read=[secret_dir])
        with pytest.raises(BlockingIOError):  # nobody connected
            server.accept()
    finally:
        server.close()
    assert time.monotonic() - started < LIMITS.wall_s + 1.5
    assert result.status != "ok"
    assert result.status in EXPECTED.get(name, {"forbidden", "error"}), result
    assert target.read_text() == "original"
    assert "s3cret-token" not in result.stdout + result.stderr
    assert len(result.stdout) <= LIMITS.output_bytes


def test_refusal_cannot_be_caught(tmp_path, leaves_nothing):
    target = tmp_path / "x.txt"
    code = f"try:\n    open({str(target)!r}, 'w')\nexcept BaseException:\n    print('caught')"
    result = run_python(code, limits=LIMITS)
    assert result.status == "forbidden" and "caught" not in result.stdout
    assert not target.exists()


@pytest.mark.parametrize(
    "runs", [100, pytest.param(1000, marks=pytest.mark.by_hand, id="1000-by-hand")]
)
def test_benign_runs_leave_nothing(leaves_nothing, runs):
    for i in range(runs):
        result = run_python(f"print({i} * 2)")
        assert (result.status, result.stdout) == ("ok", f"{2 * i}\n")


def test_stdin_stdout_round_trip(leaves_nothing):
    text = "héllo\nwörld ✓\n" * 1000
    result = run_python("import sys\nsys.stdout.write(sys.stdin.read())", stdin=text)
    assert result.ok and result.stdout == text and result.exit_code == 0


def test_private_directory_and_environment(leaves_nothing):
    code = (
        "import os, sys\nopen('scratch.txt', 'w').write('ok')\n"
        "print(os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])\n"
        "print(oct(os.stat('.').st_mode & 0o777), sorted(os.environ))"
    )
    result = run_python(code)
    assert result.ok, result.stderr
    first, second = result.stdout.splitlines()
    assert first == "True"
    assert second.startswith("0o700")
    assert "PYTHONPATH" not in second


def test_failures_are_results(leaves_nothing):
    error = run_python("raise ValueError('boom')")
    assert error.status == "error" and error.exit_code == 1
    assert "ValueError: boom" in error.stderr and "sandbox" not in error.stderr
    assert run_python("import sys; sys.exit(3)").exit_code == 3
    binary = run_python("import sys; sys.stdout.buffer.write(b'\\xff\\xfeok')")
    assert binary.ok and binary.stdout.endswith("ok")
    syntax = run_python("def (:")
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr


def test_timeout_result():
    result = run_python("import time; time.sleep(30)", limits=SandboxLimits(wall_s=0.5))
    assert result.status == "timeout" and result.exit_code is None
    assert 0.5 <= result.wall_s < 2


def test_bad_limits_raise():
    with pytest.raises(SandboxError, match="SandboxLimits.wall_s"):
        SandboxLimits(wall_s=0)
    with pytest.raises(SandboxError, match="SandboxLimits.max_open_files"):
        SandboxLimits(max_open_files=2)


def test_isolation_is_reported():
    layers = isolation().layers
    assert {"rlimits", "session", "audithook"} <= set(layers)
    if "pidns" in layers:  # the program is its namespace's first process
        assert run_python("import os; print(os.getpid())").stdout == "1\n"


@pytest.mark.skipif("netns" not in isolation().layers, reason="no network namespace here")
def test_network_namespace_alone_blocks_loopback():
    """The kernel layer without the audit hook: the host's 127.0.0.1 is unreachable."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), 2)"
    try:
        done = subprocess.run(
            [*isolation().prefix, sys.executable, "-I", "-S", "-c", code],
            capture_output=True,
            text=True,
            timeout=10,
        )
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    assert done.returncode != 0 and "OSError" in done.stderr


def test_without_namespaces_nothing_is_left(monkeypatch, leaves_nothing):
    """The fallback when ``unshare`` is unavailable: the process group is killed."""
    bare = Isolation(prefix=(), drop_uid=isolation().drop_uid, layers=("rlimits", "session"))
    monkeypatch.setattr(runner, "isolation", lambda: bare)
    assert run_python("print(1)").stdout == "1\n"
    result = run_python("import time\ntime.sleep(100)", limits=SandboxLimits(wall_s=0.5))
    assert result.status == "timeout"
    assert run_python("x = bytearray(100 * 2**30)", limits=LIMITS).status == "memory"
