"""The evaluation command's work on the driver: every row sampled n times against
started servers, a row whose environment fails reported instead of fatal, and the
contents of ``eval.json``.

One ``GymGenerator`` per server (``evaluation=True``: ``eval_sampling_params``, no
routes) serves the whole evaluation, and row i goes to server i mod their number: a
generator sends trajectory j of a call to server j mod that number, which with one
sample a row would put every row on the first server. Each row is one ``generate``
call of its n samples, so a row whose environment raises fails alone: its call
stops, the row is reported by file and row, and the other rows go on. Rows run
concurrently, at most ``max_concurrent_trajectories // n`` of them (at least one), so
the servers see about as many trajectories at once as a training rollout sends; each
row's request seeds derive from (``trainer.seed``, its row number), so a sampled
evaluation gives the same samples whatever order the rows finish in.

An environment failure is an exception the row's environment raises while it is
built or in ``init``, ``step`` or ``close``. Any other failure (a server gone, a
reply that breaks the protocol) stops the evaluation: it says nothing about the row.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

import skyrl_gym
from skyrl_train.algorithms.pass_at_k import RowSamples, pass_at_k_levels, summarize
from skyrl_train.config.schema import PPOConfig
from skyrl_train.dataset.prompts import RowRef
from skyrl_train.generators.base import GeneratorInput
from skyrl_train.generators.gym_generator import GymGenerator
from skyrl_train.utils.durable import replace_file

logger = logging.getLogger(__name__)

REPORT_FORMAT = "skyrl-r3-eval"
REPORT_VERSION = 1
_ERROR_CHARS = 500
"""An environment's exception message is cut to this many characters in the report."""


@dataclass(frozen=True)
class EvalRow:
    """One row to score: its position in the evaluation data (its seeds derive from
    it), where it came from, and the task."""

    index: int
    ref: RowRef
    task: skyrl_gym.Task


@dataclass(frozen=True)
class RowFailure:
    """A row left out of the scores because its environment raised."""

    index: int
    """The row's position in the evaluation data (``EvalRow.index``)."""
    ref: RowRef
    data_source: str
    env_class: str
    stage: str
    """Where the environment raised: ``make`` (while built), ``init``, ``step`` or ``close``."""
    error: str
    """The exception's type and message."""

    @classmethod
    def of(cls, row: EvalRow, stage: str, exc: BaseException) -> RowFailure:
        text = f"{type(exc).__name__}: {exc}"
        if len(text) > _ERROR_CHARS:
            text = text[: _ERROR_CHARS - 3] + "..."
        task = row.task
        return cls(row.index, row.ref, task.data_source, task.env_name, stage, text)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.ref.key,
            "file": self.ref.file,
            "row": self.ref.row,
            "data_source": self.data_source,
            "env_class": self.env_class,
            "stage": self.stage,
            "error": self.error,
        }

    def __str__(self) -> str:
        return f"{self.ref}: environment {self.env_class!r} raised in {self.stage}: {self.error}"


def check_environments(
    rows: Sequence[tuple[RowRef, skyrl_gym.Task]],
    env_configs: Mapping[str, Any],
    *,
    max_turns: int | None,
) -> tuple[list[EvalRow], list[RowFailure]]:
    """Build (and close) each row's environment once, as training's loading does, so
    the launch can refuse data no row of which works before anything starts; a row
    whose environment raises is set aside as a failure instead of stopping the load."""
    runnable, failures = [], []
    for index, (ref, task) in enumerate(rows):
        row = EvalRow(index, ref, task)
        try:
            env = skyrl_gym.make_task_env(
                task.env_name, task.env_extras, env_configs=env_configs, max_turns=max_turns
            )
            env.close()
        except Exception as exc:  # the row's own code: any exception is the row's failure
            failures.append(RowFailure.of(row, "make", exc))
            continue
        runnable.append(row)
    return runnable, failures


class _EnvWatch:
    """Builds one row's environments and keeps the first exception any of them raised."""

    def __init__(self) -> None:
        self.failure: tuple[str, BaseException] | None = None

    def make(self, name: str, **kwargs: Any) -> _WatchedEnv:
        env = self.call("make", skyrl_gym.make, name, **kwargs)
        return _WatchedEnv(env, self)

    def call(self, stage: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if self.failure is None:
                self.failure = (stage, exc)
            raise


class _WatchedEnv:
    """An environment whose exceptions are recorded by its row's ``_EnvWatch``."""

    def __init__(self, env: Any, watch: _EnvWatch) -> None:
        self.env = env
        self.watch = watch

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], Any]:
        return self.watch.call("init", self.env.init, prompt)

    def step(self, action: str) -> Any:
        return self.watch.call("step", self.env.step, action)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            self.watch.call("close", close)


def row_seed(seed: int, index: int) -> int:
    """Request seeds of evaluation row ``index`` derive from this."""
    return int(np.random.SeedSequence([seed, 0x6576616C, index]).generate_state(1)[0])


async def score_rows(
    generators: Sequence[GymGenerator],
    rows: Sequence[EvalRow],
    *,
    n: int,
    seed: int,
    progress: bool = True,
) -> tuple[list[RowSamples], list[RowFailure]]:
    """Sample every row ``n`` times, row i with ``generators[i % len(generators)]``;
    returns the scored rows (in row order) and the rows whose environment raised. Any
    other exception stops every row and is raised."""
    width = generators[0].config.max_concurrent_trajectories
    gate = asyncio.Semaphore(max(1, width // n))
    bar = tqdm(total=len(rows), desc="eval rows", unit="row", disable=not progress)

    async def one(row: EvalRow) -> RowSamples | RowFailure:
        task, watch = row.task, _EnvWatch()
        batch = GeneratorInput(
            prompts=[task.prompt] * n,
            env_names=[task.env_name] * n,
            env_extras=[task.env_extras] * n,
        )
        generator = generators[row.index % len(generators)]
        async with gate:
            try:
                out = await generator.generate(
                    batch, seed=row_seed(seed, row.index), make_env=watch.make
                )
            except Exception:
                if watch.failure is None:
                    raise
                failure = RowFailure.of(row, *watch.failure)
                logger.warning("%s; the row is left out of the scores", failure)
                return failure
            finally:
                bar.update(1)
        return RowSamples(
            data_source=task.data_source,
            rewards=tuple(float(r) for r in out.rewards),
            solved=tuple(out.solved or [None] * n),
            response_lengths=tuple(len(ids) for ids in out.response_ids),
            generated_tokens=tuple(sum(mask) for mask in out.loss_masks),
        )

    running = [asyncio.ensure_future(one(row)) for row in rows]
    try:
        results = await asyncio.gather(*running)
    finally:
        for future in running:
            future.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        bar.close()
    scored = [r for r in results if isinstance(r, RowSamples)]
    return scored, [r for r in results if isinstance(r, RowFailure)]


async def evaluate(
    cfg: PPOConfig,
    clients: Sequence[Any],
    tokenizer: Any,
    rows: Sequence[EvalRow],
    *,
    refused: Sequence[RowFailure] = (),
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Score ``rows`` against ``clients`` and return the ``eval.json`` contents;
    ``refused``: rows whose environment already failed to build (reported with the
    ones that fail now)."""
    gen = cfg.generator
    n = gen.eval_n_samples_per_prompt
    if n > 1 and gen.eval_sampling_params.temperature == 0.0:
        logger.warning(
            "generator.eval_n_samples_per_prompt=%d with greedy eval_sampling_params: "
            "the %d samples of a row are equal, so pass@k equals pass@1",
            n,
            n,
        )
    generators = [
        GymGenerator(
            client,
            tokenizer,
            gen,
            evaluation=True,
            progress=False,
            vocab_size=vocab_size,
            env_configs=cfg.environment.skyrl_gym,
        )
        for client in clients
    ]
    started = time.perf_counter()
    scored, failed = await score_rows(
        generators,
        rows,
        n=n,
        seed=cfg.trainer.seed,
        progress=cfg.logging.progress_bar,
    )
    failures = sorted([*refused, *failed], key=lambda failure: failure.index)
    ks = pass_at_k_levels(n)
    sampling = gen.eval_sampling_params
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "model": cfg.model.path,
        "val_data": list(cfg.data.val_data),
        "environment": {
            "env_class": cfg.environment.env_class,
            "skyrl_gym": dict(cfg.environment.skyrl_gym),
        },
        "eval_sampling_params": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
        },
        "n_samples_per_prompt": n,
        "seed": cfg.trainer.seed,
        "ks": ks,
        **summarize(
            scored, ks=ks, failed_rows=Counter(failure.data_source for failure in failures)
        ),
        "failed_rows": [failure.to_json() for failure in failures],
        "wall_s": time.perf_counter() - started,
    }


def write_report(path: Path, report: Mapping[str, Any]) -> None:
    """Write ``report`` as ``path`` whole or not at all, replacing an earlier one."""
    if path.exists():
        logger.info("replacing the earlier evaluation's %s", path)
    replace_file(path, json.dumps(report, indent=1).encode() + b"\n")
