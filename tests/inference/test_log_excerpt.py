"""What a stopped engine's report quotes from its log (``inference.errors.log_excerpt``):
the first error of the log's last launch, which a dying vLLM buries under a traceback
per failed request, then the last lines; each engine start, builtin or vLLM, opens its
part of the log with a marker line."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.errors import (
    LAUNCH_MARKER,
    CheckpointFormatError,
    EngineStartError,
    EngineStoppedError,
    log_excerpt,
    mark_launch,
    read_first_error,
    read_log_tail,
)
from inference.server.actor import InferenceServerActor
from inference.server.launch import EngineSpec
from inference.vllm.process import VLLMServerProcess, VLLMServerSpec

WORKER = "(Worker pid=7) ERROR 12-05 03:41:40 [multiproc_executor.py:1063]"
API = "(APIServer pid=5) ERROR 12-05 03:41:41 [vllm_error.py:54]"


def _vllm_like_log(path: Path) -> None:
    lines = [
        "(APIServer pid=5) INFO starting",
        # A warning's traceback at startup: not an error of the run.
        "(APIServer pid=5) WARNING [base.py:380] Traceback (most recent call last):",
        "(APIServer pid=5) WARNING [base.py:380] ValueError: Tokenizer not available",
        f"{WORKER} WorkerProc hit an exception.",
        f"{WORKER} Traceback (most recent call last):",
        *(f'{WORKER}   File "gpu_model_runner.py", line {n}, in sample_tokens' for n in range(3)),
        f"{WORKER} RuntimeError: CPU Generator does not use offset",
        *(f"{API} EngineDeadError: EngineCore encountered an issue ({n})" for n in range(300)),
        "INFO:     Shutting down",
    ]
    path.write_text("\n".join(lines) + "\n")


def test_the_first_error_is_quoted_before_the_tail(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    _vllm_like_log(log)
    first = read_first_error(log)
    assert first.splitlines()[0] == f"{WORKER} WorkerProc hit an exception."
    assert first.splitlines()[-1] == f"{WORKER} RuntimeError: CPU Generator does not use offset"
    assert len(first.splitlines()) == 6
    excerpt = log_excerpt(log, 5)
    assert excerpt == (
        f"--- the first error in its log ({log}) ---\n{first}\n"
        f"--- last log lines ({log}) ---\n{read_log_tail(log, 5)}"
    )
    assert excerpt.endswith("INFO:     Shutting down")
    # A long traceback keeps its head and its exception line.
    capped = read_first_error(log, max_lines=3).splitlines()
    assert capped[:2] == first.splitlines()[:2] and capped[-1] == first.splitlines()[-1]


def test_a_log_without_errors_or_no_log_quotes_only_what_there_is(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    log.write_text("2026 INFO inference.server.actor: serving /c at http://127.0.0.1:1\n")
    assert read_first_error(log) == ""
    assert log_excerpt(log) == f"--- last log lines ({log}) ---\n{log.read_text().strip()}"
    assert log_excerpt(tmp_path / "absent.log") == ""


def test_the_stopped_error_names_each_engine_then_its_excerpt() -> None:
    err = EngineStoppedError(
        "generator.inference_engine: expected every vllm engine to run until the end, got 2 "
        "that stopped mid-run:",
        [
            ("engine 0 (http://a)", "the vLLM server exited with code -9", "--- x ---\ny", "/l0"),
            ("engine 1 (http://b)", "its actor is gone (ActorDiedError: gone)", "", None),
        ],
    )
    assert str(err).splitlines()[1:] == [
        "engine 0 (http://a): the vLLM server exited with code -9",
        "--- x ---",
        "y",
        "engine 1 (http://b): its actor is gone (ActorDiedError: gone)",
    ]
    assert [entry[3] for entry in err.stopped] == ["/l0", None]


EARLIER = [
    "2026 INFO inference.server.actor: starting the engine on /ckpt",
    f"{WORKER} WorkerProc hit an exception.",
    f"{WORKER} RuntimeError: an earlier launch's crash",
]


def test_the_first_error_is_searched_after_the_last_launch_marker(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    log.write_text("\n".join(EARLIER) + "\n")
    mark_launch(log)
    log.write_text(log.read_text() + "\n".join(EARLIER) + "\n")  # a second launch, same crash
    mark_launch(log)
    with log.open("a") as file:
        file.write("2026 INFO inference.server.actor: serving /ckpt at http://127.0.0.1:1\n")
    # This launch logged no error: nothing is quoted as one, whatever came before.
    assert read_first_error(log) == ""
    assert "the first error" not in log_excerpt(log, 1)
    with log.open("a") as file:
        file.write(f"{API} Traceback (most recent call last):\n{API} KeyError: 'this launch'\n")
        file.write("INFO:     Shutting down\n")
    first = read_first_error(log)
    assert first == f"{API} Traceback (most recent call last):\n{API} KeyError: 'this launch'"
    excerpt = log_excerpt(log, 1)
    assert excerpt == (
        f"--- the first error in its log ({log}) ---\n{first}\n"
        f"--- last log lines ({log}) ---\nINFO:     Shutting down"
    )
    assert "earlier launch" not in excerpt
    # The marker is one whole line of its own, at the end of the earlier part.
    assert sum(line.startswith(LAUNCH_MARKER) for line in log.read_text().splitlines()) == 2


def test_each_builtin_server_start_opens_its_part_of_the_log(tmp_path: Path) -> None:
    log = tmp_path / "engines" / "engine-0.log"
    log.parent.mkdir()
    log.write_text("\n".join(EARLIER) + "\n")
    actor = InferenceServerActor(
        EngineSpec(checkpoint=str(tmp_path / "missing")), log_file=str(log)
    )
    with pytest.raises(CheckpointFormatError):
        actor.start()
    lines = log.read_text().splitlines()
    assert lines[: len(EARLIER)] == EARLIER and lines[len(EARLIER)].startswith(LAUNCH_MARKER)
    first = read_first_error(log).splitlines()
    assert first[0].endswith("ERROR inference.server.actor: the server did not start")
    assert first[-1].startswith("inference.errors.CheckpointFormatError: folder: expected")
    assert "earlier launch" not in actor.log_excerpt(2)


def test_each_vllm_server_start_opens_its_part_of_the_log(tmp_path: Path) -> None:
    python = tmp_path / "python"  # a "vLLM" that logs an error and exits
    python.write_text(
        "#!/bin/sh\necho 'ERROR 12-05 [api_server.py:1] startup failed'\n"
        'echo "ValueError: this launch\'s error"\nexit 1\n'
    )
    python.chmod(0o755)
    log = tmp_path / "engine-0.log"
    log.write_text("\n".join(EARLIER) + "\n")
    server = VLLMServerProcess(
        VLLMServerSpec(checkpoint=str(tmp_path), python=str(python), log_file=str(log))
    )
    with pytest.raises(EngineStartError, match="exited with code 1"):
        server.start()
    lines = log.read_text().splitlines()
    assert lines[: len(EARLIER)] == EARLIER and lines[len(EARLIER)].startswith(LAUNCH_MARKER)
    assert read_first_error(log) == (
        "ERROR 12-05 [api_server.py:1] startup failed\nValueError: this launch's error"
    )
    assert "earlier launch" not in server.log_excerpt(2)
