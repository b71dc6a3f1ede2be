"""``run_python``: run model-written Python in a separate, limited process.

The program gets a private directory (0700; its cwd, HOME and TMPDIR), an empty
environment but for PATH and LANG, no network, limits on wall time, CPU, memory,
processes, file sizes and output, and the layers ``isolation()`` found on this
host. Whatever it does, the call returns a ``SandboxResult`` saying how it ended,
and leaves no process and no file behind. ``SandboxError`` means the sandbox itself
could not start (a host problem), never that the program misbehaved.
"""

from __future__ import annotations

import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from skyrl_gym.error import SandboxError
from skyrl_gym.sandbox import _bootstrap
from skyrl_gym.sandbox.isolation import isolation
from skyrl_gym.sandbox.limits import DEFAULT_LIMITS, SandboxLimits

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "forbidden", "killed")
"""``error``: a non-zero exit (an exception); ``timeout``: wall clock or CPU limit;
``forbidden``: the audit hook refused an operation; ``killed``: another signal."""
MARKER = "SKYRL_SANDBOX_RUN"
_BOOTSTRAP = Path(_bootstrap.__file__).read_text(encoding="utf-8")
_GRACE_S = 0.25
"""After the program's first process exits, how long a leftover child may hold its pipes."""


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """The exit status; negative for a signal, None if it never ended on its own."""
    status: str
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _real_roots(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    return sorted({os.path.realpath(os.fspath(p)) for p in paths if os.fspath(p)})


def _settings(limits: SandboxLimits, deny_read: Sequence[str | os.PathLike[str]]) -> str:
    cpu = int(limits.cpu_s)
    rlimits: dict[str, object] = {
        "RLIMIT_AS": limits.memory_bytes,
        "RLIMIT_CPU": cpu,  # SIGKILL at the limit: as a namespace's init, SIGXCPU is ignored
        "RLIMIT_FSIZE": limits.max_file_bytes,
        "RLIMIT_NOFILE": limits.max_open_files,
        "RLIMIT_CORE": 0,
    }
    iso = isolation()
    if iso.drop_uid is not None:  # for the caller's own uid it would count all its processes
        rlimits["RLIMIT_NPROC"] = limits.max_processes
    deny = [os.path.expanduser("~"), os.getcwd(), *deny_read]
    allow = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    if limits.site_packages:
        allow.update(p for p in sys.path if p and os.path.isdir(p))
    settings = {
        "uid": iso.drop_uid,
        "rlimits": rlimits,
        "deny": [r for r in _real_roots(deny) if r != "/"],
        "allow_read": _real_roots(sorted(allow)),
    }
    return repr(settings)  # a literal the bootstrap evaluates (see there)


def _make_box(code: str, stdin: str) -> str:
    try:
        box = tempfile.mkdtemp(prefix="skyrl-sandbox-")  # 0700
    except OSError as exc:
        raise SandboxError(f"sandbox.directory: expected a private temp dir, got {exc!r}") from exc
    try:
        Path(box, "main.py").write_text(code, encoding="utf-8", errors="surrogatepass")
        Path(box, ".stdin").write_text(stdin, encoding="utf-8", errors="surrogatepass")
        uid = isolation().drop_uid
        if uid is not None:
            for path in (box, f"{box}/main.py", f"{box}/.stdin"):
                os.chown(path, uid, uid)
    except (OSError, UnicodeError) as exc:
        _remove_box(box)
        raise SandboxError(f"sandbox.directory: expected to write {box}, got {exc!r}") from exc
    return box


def _remove_box(box: str) -> None:
    def unlock(func: Any, path: str, _exc: Any) -> None:
        # The program may have made a subdirectory unreadable or unwritable; a second
        # failure propagates (a directory left behind is a host problem worth raising).
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        func(path)

    try:
        shutil.rmtree(box, onerror=unlock)
    except OSError as exc:
        raise SandboxError(f"sandbox.directory: expected to remove {box}, got {exc!r}") from exc


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_marked(token: bytes) -> None:
    """Without a PID namespace: kill what escaped the process group (setsid, double
    fork), found by the marker in its environment."""
    for _ in range(3):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if token in f.read():
                        os.kill(int(entry), signal.SIGKILL)
                        found = True
            except OSError:
                continue
        if not found:
            return
        time.sleep(0.01)


class _Drained(NamedTuple):
    out: bytes
    err: bytes
    truncated: tuple[bool, bool]
    reason: str | None
    """``timeout`` or ``output_limit`` when the parent must kill the program, else None."""
    waited: tuple[int, int, Any] | None
    """``os.wait4``'s answer once the first process has exited, else None."""


def _read(proc: subprocess.Popen[bytes], limits: SandboxLimits, start: float) -> _Drained:
    """Drain stdout and stderr, each up to ``limits.output_bytes``, until both close,
    the wall-clock limit passes, or the output cap is crossed."""
    assert proc.stdout is not None and proc.stderr is not None
    fds = (proc.stdout.fileno(), proc.stderr.fileno())
    buffers = {fd: bytearray() for fd in fds}
    truncated = dict.fromkeys(fds, False)
    sel = selectors.DefaultSelector()
    for fd in fds:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    reason: str | None = None
    exited_at: float | None = None
    waited: tuple[int, int, Any] | None = None
    while sel.get_map():
        now = time.monotonic()
        if now - start >= limits.wall_s:
            reason = "timeout"
            break
        if waited is None:
            answer = os.wait4(proc.pid, os.WNOHANG)
            if answer[0] != 0:
                waited, exited_at = answer, now
        if exited_at is not None and now - exited_at > _GRACE_S:
            break
        for key, _ in sel.select(timeout=min(0.05, limits.wall_s - (now - start))):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            buf = buffers[key.fd]
            room = limits.output_bytes - len(buf)
            buf += chunk[: max(room, 0)]
            if len(chunk) > room:
                truncated[key.fd] = True
                reason = "output_limit"
        if reason:
            break
    sel.close()
    out, err = (bytes(buffers[fd]) for fd in fds)
    return _Drained(out, err, (truncated[fds[0]], truncated[fds[1]]), reason, waited)


def _wait_until(pid: int, deadline: float) -> tuple[int, int, Any] | None:
    """``os.wait4(pid)`` if the process exits before ``deadline``, else None."""
    pause = 0.0005
    while True:
        answer = os.wait4(pid, os.WNOHANG)
        if answer[0] != 0:
            return answer
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _status(reason: str | None, code: int, cpu_used: float, limits: SandboxLimits) -> str:
    if reason:
        return reason
    if code == 0:
        return "ok"
    if code == _bootstrap.EXIT_FORBIDDEN:
        return "forbidden"
    if code == _bootstrap.EXIT_MEMORY:
        return "memory"
    if cpu_used >= limits.cpu_s - 0.1:  # killed at the CPU limit (unshare reports it as 1)
        return "timeout"
    return "killed" if code < 0 else "error"


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits = DEFAULT_LIMITS,
    deny_read: Sequence[str | os.PathLike[str]] = (),
) -> SandboxResult:
    """Run ``code`` as ``__main__`` with ``stdin``; never raises for the program's doing.

    ``deny_read``: directories the program may not read (a run folder, a data set),
    beside the caller's home and working directory, which are always denied.
    """
    iso = isolation()
    box = _make_box(code, stdin)
    token = secrets.token_hex(12)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": box, "TMPDIR": box, MARKER: token}
    flags = ["-I"] if limits.site_packages else ["-I", "-S"]
    cmd = [
        *iso.prefix,
        sys.executable,
        *flags,
        "-c",
        _BOOTSTRAP,
        box,
        _settings(limits, deny_read),
    ]
    start = time.monotonic()
    try:
        with open(f"{box}/.stdin", "rb") as stdin_file:
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    cwd=box,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                raise SandboxError(f"sandbox.start: expected to run {cmd[0]}, got {exc!r}") from exc
        waited = None
        try:
            out, err, truncated, reason, waited = _read(proc, limits, start)
            if waited is None and reason is None:  # it closed its pipes but may still run
                waited = _wait_until(proc.pid, start + limits.wall_s)
                reason = None if waited else "timeout"
        finally:
            _kill_group(proc.pid)  # the program's process group; with a PID namespace, all of it
            _, wait_status, usage = waited or os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
            proc.stdout.close()  # type: ignore[union-attr]
            proc.stderr.close()  # type: ignore[union-attr]
            if not iso.pid_namespace:
                _kill_marked(f"{MARKER}={token}".encode())
        wall = time.monotonic() - start
    finally:
        _remove_box(box)
    code_ = proc.returncode
    status = _status(reason, code_, usage.ru_utime + usage.ru_stime, limits)
    return SandboxResult(
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        exit_code=None if reason else code_,
        status=status,
        wall_s=wall,
        stdout_truncated=truncated[0],
        stderr_truncated=truncated[1],
    )
