"""``python -m skyrl_train.entrypoints.main_base [key=value ...]``: GRPO with R3 on Ray.

Read top to bottom: parse and validate the config, start or join Ray, place the
inference server actors and the ``trainer.placement.num_trainers`` policy actors by
their CPU resources, give the servers the trainer's exact weights, run the GRPO loop,
plot, and tear everything down whatever happened (success, exception or Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig

from skyrl_train.config.compose import CONFIG_DIR, CONFIG_NAME, check_override_keys, parse_config
from skyrl_train.config.paths import resolve_paths
from skyrl_train.config.schema import PPOConfig
from skyrl_train.config.validate import validate_cfg
from skyrl_train.errors import ConfigValidationError
from skyrl_train.utils.logs import console_logging, job_log

if TYPE_CHECKING:
    from skyrl_train.runs.claim import RunDirClaim
    from skyrl_train.trainer.engines import Engines

# Named, not __name__: run as ``python -m`` this module is ``__main__``, and the console
# shows only skyrl_train.* INFO lines bare (utils.logs).
logger = logging.getLogger("skyrl_train.entrypoints.main_base")

ENGINE_LOGS = "engines"
"""``<run_dir>/engines/engine-<i>.log``: each inference server's own log, kept."""


@dataclass
class Job:
    """A launched run: its servers and policy actors, ready to train."""

    cfg: PPOConfig
    server_urls: list[str]
    policy: Any
    """The ``PolicyGroup``: one actor per trainer rank."""
    loop: Any
    api_key: str | None = field(repr=False)
    """The run's bearer token, shared by its servers and clients only (with
    ``remote_urls``: the key their environment variable holds, or None)."""

    def train(self) -> list[dict[str, float]]:
        async def go() -> list[dict[str, float]]:
            start = 0
            if self.cfg.trainer.resume_from:
                start = await self.loop.load_checkpoint(self.cfg.trainer.resume_from)
            # The servers built their own bf16 copy; pushing the trainer's weights first
            # makes rollout and trainer start from the same tensors, resumed runs included.
            await self.policy.push_weights(
                self.server_urls, api_key=self.api_key, policy_version=start
            )
            return await self.loop.run(start_step=start)

        return asyncio.run(go())


@contextlib.contextmanager
def launch(cfg: PPOConfig) -> Iterator[Job]:
    """Start (or join) Ray and place every actor; on exit stop and remove them all."""
    from skyrl_train.runs.claim import hold_run_dir

    # Absolute before anything reads a path: actors and vLLM servers run in other folders.
    cfg = resolve_paths(cfg)
    validate_cfg(cfg)
    # The run folder is held from here to the run's end, before any work (datasets,
    # checkpoint hashes): a second launch into it is refused now, naming this one.
    with hold_run_dir(cfg) as claim, _launch_held(cfg, claim) as job:
        yield job


@contextlib.contextmanager
def _launch_held(cfg: PPOConfig, claim: RunDirClaim) -> Iterator[Job]:
    from skyrl_train.config.model_source import inspect_folder, model_checkpoint
    from skyrl_train.dataset.prompts import load_datasets
    from skyrl_train.runs.folder import resolve_resume
    from skyrl_train.trainer.engine_clients import ClientOptions
    from skyrl_train.trainer.loop import GRPOLoop

    # Every dataset row is checked (and its environment built once) now: a bad row
    # fails naming file, row and key before Ray or any model starts.
    datasets = load_datasets(cfg)
    # Hash trainer.resume_from against its manifest now: a damaged checkpoint fails in
    # seconds naming the file, not after Ray and every actor have started. "latest"
    # is resolved here, once; the Job and everything after it read this cfg.
    cfg = resolve_resume(cfg)
    # Accepted only now, after every check: a refused launch leaves nothing, and an
    # accepted one writes run.json (and deletes what a branch supersedes) before
    # anything else (runs.claim).
    run_dir = claim.accept(cfg)
    with job_log(run_dir / "main_base.log"):
        # model.path, or the built-in model written once as a folder: from here on every
        # run loads a checkpoint folder the same way (engines, trainers, tokenizer).
        checkpoint = model_checkpoint(cfg.model)
        info = inspect_folder(checkpoint)
        placement = cfg.trainer.placement
        trainer_cpus = (placement.num_trainers, placement.cpus_per_trainer)
        more_cpus = {"trainer.placement.cpus_per_trainer": trainer_cpus}
        trainers = _TrainerRanks(cfg, checkpoint=str(checkpoint), pad_token_id=info.pad_token_id)
        with serving(
            cfg, checkpoint, more_cpus=more_cpus, log_dir=run_dir / ENGINE_LOGS, beside=trainers
        ) as engines:
            urls, server_key = engines.urls, engines.api_key
            policy = trainers.ready()
            loop = GRPOLoop(
                cfg,
                tokenizer=info.tokenizer,
                server_urls=urls,
                policy=policy,
                pad_token_id=info.pad_token_id,
                api_key=server_key,
                datasets=datasets,
                client_options=ClientOptions.for_run(cfg, info, api_key=server_key),
                vocab_size=info.architecture.vocab_size,
                num_experts=info.architecture.num_experts,
            )
            yield Job(cfg=cfg, server_urls=urls, policy=policy, loop=loop, api_key=server_key)


class _TrainerRanks(contextlib.AbstractContextManager["_TrainerRanks"]):
    """The trainer ranks, placed as soon as Ray is up and built while the inference
    servers load: each is a process importing torch and building a model, seconds of
    one core's work that queued one after the other before. Exiting removes them,
    before the servers stop and Ray goes."""

    def __init__(self, cfg: PPOConfig, *, checkpoint: str, pad_token_id: int) -> None:
        self.cfg, self.checkpoint, self.pad_token_id = cfg, checkpoint, pad_token_id
        self.group: Any = None
        self.pending: list[Any] = []

    def __enter__(self) -> _TrainerRanks:
        from skyrl_train.trainer.policy_group import PolicyGroup

        self.group = PolicyGroup.place(
            self.cfg, checkpoint=self.checkpoint, pad_token_id=self.pad_token_id
        )
        try:
            self.pending = self.group.start_setup()
        except BaseException:
            self.group.kill()
            raise
        return self

    def ready(self) -> Any:
        """The ``PolicyGroup``, every rank built."""
        self.group.finish_setup(self.pending)
        return self.group

    def __exit__(self, *exc: object) -> None:
        if self.group is not None:
            self.group.kill()


@contextlib.contextmanager
def serving(
    cfg: PPOConfig,
    checkpoint: Path,
    *,
    more_cpus: Mapping[str, tuple[int, float]] | None = None,
    log_dir: Path | None = None,
    beside: contextlib.AbstractContextManager[Any] | None = None,
) -> Iterator[Engines]:
    """Start or join Ray and the run's inference servers on ``checkpoint`` (or take
    ``remote_urls``); on exit stop every server and the Ray this started, whatever
    ended the run. ``more_cpus``: the other actors the caller will place, checked with
    the servers' CPUs before anything starts (``require_cpus``). ``log_dir``: where
    each server writes ``engine-<i>.log``, kept after the run (``Engines.log_dir``).
    ``beside``: entered once Ray is up, before the servers start, and exited before
    they stop (the launch's trainer ranks)."""
    from skyrl_train.trainer.engines import Engines
    from skyrl_train.utils.ray_session import require_cpus, start_ray

    # One bearer token per run, handed to servers and clients as Ray call arguments:
    # never printed, and on no command line of the builtin server (ps shows those).
    # A vLLM server still gets it as --api-key (inference.vllm.spec.vllm_command),
    # though vLLM also reads it from VLLM_API_KEY.
    api_key = secrets.token_urlsafe(32)
    ray_session = start_ray(
        address=cfg.ray.address,
        num_cpus=cfg.ray.num_cpus,
        runtime_env=cfg.ray.runtime_env,
    )
    engine = cfg.generator.inference_engine
    engines = Engines(engine, sample_support_k=cfg.generator.max_sample_support_k, log_dir=log_dir)
    try:
        require_cpus(
            {
                "generator.inference_engine.num_cpus_per_engine": (
                    0 if engine.remote_urls else engine.num_engines,
                    engine.num_cpus_per_engine,
                ),
                **(more_cpus or {}),
            },
            local=cfg.ray.address is None,
        )
        with contextlib.ExitStack() as stack:
            if beside is not None:
                stack.enter_context(beside)
            # builtin or vLLM servers on the checkpoint folder, or remote_urls as given.
            engines.start(checkpoint, api_key=api_key)
            try:
                yield engines
            except Exception:
                # A server killed mid-run surfaces as a connection error in some step, and
                # vLLM's dead EngineCore as an HTTP 500: name the engine that stopped, with
                # its last log lines (EngineStoppedError), as well.
                engines.check_alive()
                raise
    finally:
        engines.stop()  # every server process, vLLM's whole process groups included
        ray_session.shutdown()


def run(cfg: PPOConfig) -> list[dict[str, float]]:
    """One training run; returns the per-step metrics and saves the plot."""
    from skyrl_train.utils.tracking import plot_metrics

    with launch(cfg) as job:
        logger.info("inference servers: %s", ", ".join(job.server_urls))
        history = job.train()
    metrics_file = Path(cfg.trainer.run_dir) / "metrics.jsonl"
    if cfg.logging.plot and metrics_file.is_file():
        logger.info("plot: %s", plot_metrics(metrics_file, metrics_file.with_suffix(".png")))
    return history


def command(run_job: Callable[[PPOConfig], object]) -> None:
    """A launch's command line: Hydra overrides, ``--cfg job``, ``-m`` sweeps, each
    job's config parsed and handed to ``run_job`` with the console logging set up."""
    # Hydra's own message for a misspelt key names no alternative; this one does.
    try:
        check_override_keys(sys.argv[1:])
    except ConfigValidationError as exc:
        sys.exit(f"error: {exc}")

    @hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")
    def hydra_job(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        job_dir = None
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            # Each sweep job runs in its own folder (hydra.sweep: <run_dir>/<job number>),
            # so two jobs never append to one metrics.jsonl.
            job_dir = Path(HydraConfig.get().runtime.output_dir)
            cfg.trainer.run_dir = str(job_dir)
        try:
            with console_logging():
                # Relative paths are the user's: against the folder the command started
                # in, even where hydra.job.chdir=true moved the process elsewhere.
                run_job(resolve_paths(parse_config(cfg), base=HydraConfig.get().runtime.cwd))
        except ConfigValidationError:
            if job_dir is not None and job_dir.is_dir() and not any(job_dir.iterdir()):
                job_dir.rmdir()  # Hydra made it for this job; a refused job leaves nothing
            raise

    hydra_job()


def main() -> None:
    """The command line: Hydra overrides, ``--cfg job``, ``-m`` sweeps."""
    command(run)


if __name__ == "__main__":
    main()
