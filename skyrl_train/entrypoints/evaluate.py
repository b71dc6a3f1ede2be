"""``python -m skyrl_train.entrypoints.evaluate [key=value ...]``: score a model on a dataset.

The same Hydra config as training (``model.path``, ``data.val_data``,
``environment.*``, ``generator.eval_sampling_params``, ``ray.*`` and the engine keys
mean what they mean there), and no trainer: read top to bottom, it validates the
config, loads the rows and builds each row's environment once, starts or joins Ray and
the inference servers only, samples every row ``generator.eval_n_samples_per_prompt``
times, writes ``<trainer.run_dir>/eval.json`` and stops everything it started,
whatever happened. Its log lines also go to ``<trainer.run_dir>/evaluate.log``, and
each server it starts writes ``<trainer.run_dir>/evaluate-engines/engine-<i>.log``
(kept: a failed evaluation's error quotes its tail; not ``engines/``, which would mark
the folder as a training run's).

``eval.json`` (``trainer.evaluation.evaluate`` builds it): the settings it ran with;
``ks``, the powers of two up to n and n itself; ``overall`` and ``by_data_source``,
each with ``rows``, ``failed_rows``, ``samples``, ``reward_mean``, ``reward_std``,
``success_rate``, ``pass@k`` for each k (the unbiased estimator,
``algorithms.pass_at_k``), ``response_length_mean``, ``generated_tokens_mean`` and
``correct_if``; and ``failed_rows``, each row whose environment raised, by file and
row. An earlier ``eval.json`` in the folder is replaced (atomically); nothing else of
a training run there is touched, and the run folder rules of training do not apply.

Greedy by default (``eval_sampling_params.temperature=0``, one sample); pass@k wants
sampling: ``generator.eval_n_samples_per_prompt=8
generator.eval_sampling_params.temperature=1.0``. A row that breaks the dataset schema
stops the launch before Ray starts, as in training; a row whose environment raises is
reported and the rest are scored (all rows failing to build is refused before Ray).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from skyrl_train.config.paths import resolve_paths
from skyrl_train.config.schema import PPOConfig
from skyrl_train.config.validate import validate_cfg
from skyrl_train.entrypoints.main_base import command, serving
from skyrl_train.errors import DatasetError
from skyrl_train.utils.logs import job_log

# Named, not __name__: run as ``python -m`` this module is ``__main__`` (see main_base).
logger = logging.getLogger("skyrl_train.entrypoints.evaluate")

REPORT_NAME = "eval.json"
LOG_NAME = "evaluate.log"
ENGINE_LOGS = "evaluate-engines"


def run(cfg: PPOConfig) -> dict[str, Any]:
    """One evaluation; returns what it wrote to ``<trainer.run_dir>/eval.json``."""
    from skyrl_train.config.model_source import inspect_folder, model_checkpoint
    from skyrl_train.dataset.prompts import eval_tasks
    from skyrl_train.trainer.engine_clients import ClientOptions, make_client
    from skyrl_train.trainer.evaluation import check_environments, evaluate, write_report

    cfg = resolve_paths(cfg)  # actors and vLLM servers run in other folders
    validate_cfg(cfg, evaluation=True)
    # Schema errors stop the launch here, naming file and row; a row whose environment
    # refuses it is only set aside, unless no row is left to score.
    rows, refused = check_environments(
        eval_tasks(cfg), cfg.environment.skyrl_gym, max_turns=cfg.generator.max_turns
    )
    if not rows:
        first = refused[0]
        raise DatasetError(
            first.ref.key,
            first.ref.file or "<generated>",
            row=first.ref.row,
            field="env_class",
            expected="at least one row its environment accepts",
            got=f"none of {len(refused)} (the first: {first.error})",
        )
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with job_log(run_dir / LOG_NAME):
        for failure in refused:
            logger.warning("%s; the row is left out of the scores", failure)
        checkpoint = model_checkpoint(cfg.model)
        info = inspect_folder(checkpoint)
        with serving(cfg, checkpoint, log_dir=run_dir / ENGINE_LOGS) as engines:
            logger.info("inference servers: %s", ", ".join(engines.urls))
            options = ClientOptions.for_run(cfg, info, api_key=engines.api_key)

            async def go() -> dict[str, Any]:
                clients = [make_client(url, options) for url in engines.urls]
                try:
                    return await evaluate(
                        cfg,
                        clients,
                        info.tokenizer,
                        rows,
                        refused=refused,
                        vocab_size=info.architecture.vocab_size,
                    )
                finally:
                    await asyncio.gather(*(client.close() for client in clients))

            report = asyncio.run(go())
        path = run_dir / REPORT_NAME
        write_report(path, report)
        overall = report["overall"]
        figures = ", ".join(
            f"{key} {overall[key]:.4f}"
            for key in ("reward_mean", "success_rate", *(f"pass@{k}" for k in report["ks"]))
            if overall[key] is not None  # None: no row scored, or no success reported
        )
        logger.info(
            "%s: %d rows x %d samples, %d failed; %s",
            path,
            overall["rows"],
            report["n_samples_per_prompt"],
            overall["failed_rows"],
            figures or "nothing scored",
        )
    return report


def main() -> None:
    """The command line: Hydra overrides and ``--cfg job``, as training's."""
    command(run)


if __name__ == "__main__":
    main()
