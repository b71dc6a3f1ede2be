"""The launch's logging (skyrl_train/utils/logs.py): this package's INFO lines bare on
the console through ``tqdm.write``, everything else with time, logger and level, and
every line timestamped in the job log. No Ray: the end-to-end CLI resume in
test_main_base checks the real ``<run_dir>/main_base.log`` of a real run."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from tqdm.auto import tqdm

from skyrl_train.utils.logs import console_logging, job_log

STEP_LINE = "step 3 reward=0.41 success=0.25"


def test_step_lines_are_bare_on_the_console_and_timestamped_in_the_job_log(
    tmp_path: Path,
) -> None:
    console = io.StringIO()
    log_file = tmp_path / "main_base.log"
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    with console_logging(console), job_log(log_file):
        logging.getLogger("skyrl_train.trainer.loop").info(STEP_LINE)
        logging.getLogger("skyrl_train.entrypoints.main_base").warning("server did not stop")
        logging.getLogger("some.library").info("library says hi")
    logging.getLogger("skyrl_train.trainer.loop").info("after the launch")
    assert (list(root.handlers), root.level) == before  # restored

    lines = console.getvalue().splitlines()
    assert lines[0] == STEP_LINE
    assert lines[1].endswith("][skyrl_train.entrypoints.main_base][WARNING] - server did not stop")
    assert lines[2].endswith("][some.library][INFO] - library says hi")
    assert len(lines) == 3  # nothing after the launch reaches its console

    logged = log_file.read_text().splitlines()
    assert len(logged) == 3
    assert logged[0].startswith("[") and logged[0].endswith(
        f"][skyrl_train.trainer.loop][INFO] - {STEP_LINE}"
    )


def test_a_log_line_is_written_above_the_progress_bar_not_into_it() -> None:
    console = io.StringIO()
    with console_logging(console):
        bar = tqdm(total=4, desc="GRPO steps", file=console, mininterval=0)
        bar.update(1)
        logging.getLogger("skyrl_train.trainer.loop").info(STEP_LINE)
        bar.update(1)
        bar.close()
    # tqdm.write cleared the bar (a carriage return) before the line and redrew it after.
    segments = console.getvalue().split("\r")
    assert any(segment.startswith(STEP_LINE + "\n") for segment in segments)
    assert "GRPO steps" in segments[-1]
