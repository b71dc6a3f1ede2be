"""The inference side's exception tree; callers decide "retry or not" from the class.

    InferenceError              root: ``except InferenceError`` catches all of the below
      WireError (ValueError)    a packed envelope or body breaks the wire contract
        GenerateProtocolError   a valid JSON reply whose packed contract is malformed
          ReplyTooLarge         a reply over the request's byte cap (client/limits.py)
      RequestValidationError (ValueError)
                                a generate request field is wrong (the server's 4xx)
      CheckpointFormatError (ValueError)
                                a model folder cannot be served or trained
      GenerateError             anything the client could not turn into a result
        GenerateHTTPError       the server answered with an error status (not retried)
        GenerateTransportError  connection refused/reset, timeout, gateway garbage (retried)
          DeadlineExceeded      the overall deadline ran out while retrying
        RetryLater              one attempt got 429/503 (client/retry.py; retried)
      Overloaded                the server's own "too many in flight" (server/app.py; a 503)
      EngineStartError          an engine server process never became healthy (vllm/process.py)
      EngineStoppedError        an engine server stopped while a run used it (names each
                                engine, with its log's last lines)

Protocol and validation errors are deterministic: retrying sends the same bytes and
gets the same failure, so they are ``ValueError`` subclasses and are never retried.

The three ``ValueError`` families share one shape: ``.path`` says where (a JSON path
such as ``$.choices[3].routed_experts.shape``, or a checkpoint file and key such as
``config.json:architectures``), ``.expected`` and ``.got`` say what, and the message
reads ``path: expected X, got Y``.
"""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path
from typing import Any


def _describe(got: Any) -> str:
    text = repr(got)
    return text if len(text) <= 120 else text[:117] + "..."


class InferenceError(Exception):
    """Root of every exception the ``inference`` package defines."""

    def __reduce__(self) -> tuple[Any, ...]:
        return reduce_by_attributes(self)


def reduce_by_attributes(err: BaseException) -> tuple[Any, ...]:
    """``err.__reduce__`` for an exception tree whose constructors take other arguments
    than its ``args`` (this one's, ``skyrl_train.errors``'): exceptions pickle as
    ``cls(*args)``, which those constructors cannot take, so one raised in a Ray actor
    reached the caller as Ray's UnserializableException. Rebuilt from its attributes
    instead, without calling ``__init__`` again."""
    return (_rebuild, (type(err), err.args, err.__dict__))


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


class _PathError(InferenceError, ValueError):
    """``path: expected X, got Y``; ``got`` is kept as is and shown as a short repr."""

    def __init__(self, path: str, expected: str, got: Any) -> None:
        self.path = path
        self.expected = expected
        self.got = got
        super().__init__(f"{path}: expected {expected}, got {_describe(got)}")


class WireError(_PathError):
    """A packed array, envelope or body violates the wire contract.

    ``path`` is a JSON path such as ``$.choices[3].routed_experts.shape``.
    """


class GenerateProtocolError(WireError):
    """The server's JSON reply was valid but its packed side channel was not."""


class RequestValidationError(_PathError):
    """A generate request field is invalid; the server answers it with a 4xx.

    ``path`` is the request field (``$.sampling_params.temperature``); ``status`` the
    HTTP status the server answers with.
    """

    def __init__(self, path: str, expected: str, got: Any, *, status: int = 400) -> None:
        self.status = status
        super().__init__(path, expected, got)


class CheckpointFormatError(_PathError):
    """A checkpoint folder is unusable: a file is missing, or config.json or the
    tokenizer asks for something no family here supports.

    ``path`` is where in the folder: a file, or a file and key
    (``config.json:architectures``).
    """


class GenerateError(InferenceError):
    """Base for failures the client reports after its retry policy ran."""


class GenerateHTTPError(GenerateError):
    """The server answered with an error status; ``message`` is the server's own."""

    def __init__(self, status: int, message: str, *, error_type: str | None = None) -> None:
        self.status = status
        self.message = message
        self.error_type = error_type
        super().__init__(f"HTTP {status}: {message}")


class GenerateTransportError(GenerateError):
    """The request never produced a usable HTTP reply; safe to retry."""


class DeadlineExceeded(GenerateTransportError):
    """The client's overall deadline expired before any attempt succeeded."""


class EngineStartError(InferenceError):
    """An engine server process exited or missed its health deadline while starting.

    Not a ``ValueError``: a start can fail for passing reasons (a port taken, a slow
    disk). ``log_tail`` holds the server's last log lines, which name the real cause
    (vLLM logs it from a child process the caller never sees), and ``log_path`` the
    whole log.
    """

    def __init__(self, message: str, *, log_tail: str = "", log_path: str | None = None) -> None:
        self.log_tail = log_tail
        self.log_path = log_path
        super().__init__(_with_log(message, log_tail, log_path))


def _with_log(message: str, log_tail: str, log_path: str | None) -> str:
    if not log_tail:
        return message
    where = f" ({log_path})" if log_path else ""
    return f"{message}\n--- last log lines{where} ---\n{log_tail}"


class EngineStoppedError(InferenceError):
    """Engine servers stopped while a run used them: a process exited or was killed,
    its actor died, or ``/health`` stopped answering 200 (vLLM's EngineCore died).

    Not a ``ValueError``: the cause is in the engine's log, not in the request.
    ``stopped`` holds one ``(engine, reason, log_excerpt, log_path)`` per engine
    (``log_excerpt``: the log's first error and last lines), and the message each
    engine's reason followed by its excerpt.
    """

    def __init__(self, message: str, stopped: list[tuple[str, str, str, str | None]]) -> None:
        self.stopped = stopped
        parts = [message]
        for engine, reason, excerpt, _ in stopped:
            parts.append(f"{engine}: {reason}" + (f"\n{excerpt}" if excerpt else ""))
        super().__init__("\n".join(parts))


def read_log_tail(path: str | Path, n: int = 40) -> str:
    """The last ``n`` lines of a server's log file ("" when there is none); reads at
    most its last 256 KiB, so a long run's log costs the same as a short one's."""
    file = Path(path)
    if not file.is_file():
        return ""
    with file.open("rb") as log:
        log.seek(0, os.SEEK_END)
        log.seek(max(0, log.tell() - 256 * 1024))
        lines = log.read().decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])


_ERROR_LEVEL = re.compile(r"\bERROR\b")
_EXCEPTION_LINE = re.compile(r"\b[A-Za-z_][\w.]*(Error|Exception)(: |$)")


LAUNCH_MARKER = "==== skyrl engine launch"
"""How each engine start's first log line begins (:func:`mark_launch`). A launch appends
to the log the engine wrote before (a resubmitted run keeps its folder), so the first
error of a log would otherwise be an earlier launch's."""


def mark_launch(path: str | Path) -> None:
    """Append the line that opens one engine start's part of the log at ``path``; call
    it where a start opens its log, before the engine writes anything."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with file.open("a", encoding="utf-8") as log:
        log.write(f"{LAUNCH_MARKER} {stamp} pid {os.getpid()} ====\n")


def _last_launch_offset(file: Path) -> int:
    """The byte offset of the log's last :data:`LAUNCH_MARKER` line (0 without one),
    found in C-speed chunk scans: a long run's log can hold millions of lines."""
    needle = ("\n" + LAUNCH_MARKER).encode()
    found, read, carry = 0, 0, b"\n"  # the carried newline: a marker on the first line
    with file.open("rb") as log:
        while chunk := log.read(1 << 20):
            data = carry + chunk
            hit = data.rfind(needle)
            if hit >= 0:
                found = read - len(carry) + hit + 1
            carry = data[-(len(needle) - 1) :]
            read += len(chunk)
    return found


def read_first_error(path: str | Path, *, max_lines: int = 40) -> str:
    """The first error of the log's last launch (from its last :data:`LAUNCH_MARKER`
    line on; the whole log when it has none): from the first ERROR-level line to the
    exception line that ends that traceback (the exception line always kept, the lines
    between capped at ``max_lines``); "" when that part has none. Where an engine died,
    that is the cause: vLLM follows it with a traceback per failed request, hundreds of
    lines that push it out of any tail (a seeded split-prompt crash logged 9,500 lines)."""
    file = Path(path)
    if not file.is_file():
        return ""
    offset = _last_launch_offset(file)
    block: list[str] = []
    with file.open("rb") as binary:
        binary.seek(offset)
        log = io.TextIOWrapper(binary, encoding="utf-8", errors="replace")
        for raw in log:
            line = raw.rstrip("\n")
            if not block:
                if _ERROR_LEVEL.search(line):
                    block.append(line)
                    if _EXCEPTION_LINE.search(line):
                        break
                continue
            if len(block) < max_lines:
                block.append(line)
            if _EXCEPTION_LINE.search(line):
                if len(block) == max_lines:
                    block[-1] = line
                break
    return "\n".join(block)


def log_excerpt(path: str | Path, n: int = 40) -> str:
    """What a report of a stopped engine quotes from its log: the first error of its
    last launch (when the last ``n`` lines do not already hold it), then the last ``n``
    lines, each under a heading naming the file."""
    first, tail = read_first_error(path), read_log_tail(path, n)
    parts = []
    if first and first not in tail:
        parts.append(f"--- the first error in its log ({path}) ---\n{first}")
    if tail:
        parts.append(f"--- last log lines ({path}) ---\n{tail}")
    return "\n".join(parts)
