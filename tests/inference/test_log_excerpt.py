"""What a stopped engine's report quotes from its log (``inference.errors.log_excerpt``):
the first error, which a dying vLLM buries under a traceback per failed request, then
the last lines."""

from __future__ import annotations

from pathlib import Path

from inference.errors import EngineStoppedError, log_excerpt, read_first_error, read_log_tail

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
