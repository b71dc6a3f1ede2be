"""The GRPO loop on the driver: generate, collate, train, sync, log, per step.

Every step is a pure function of (config, step number, policy state): its prompts
and request seeds derive from the step number, so a run resumed from a checkpoint
takes exactly the steps an uninterrupted run would have taken.

A run owns the steps after the one it starts from: resumed into the folder it was
checkpointed from, it first drops the ``metrics.jsonl`` lines (and TensorBoard
events) of the steps it is about to take again, so each step appears once; a fresh
run (start step 0) replaces the folder's metrics. Checkpoints are written crash-safely
and verified on resume (``runs/checkpoint.py``); ``trainer.max_ckpts_to_keep`` bounds them.

Kept whole: a step reads top to bottom here (generate, dynamic sampling, collate, train,
push weights, check the served weights, evaluate, checkpoint, log), as in torchtune's
recipes; the parts with their own rules (advantages, collation, checkpoint folders,
weight sync) already live in their own modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

import skyrl_gym
from skyrl_train.algorithms import (
    compute_advantages,
    contiguous_groups,
    success_rate,
    zero_variance_group_fraction,
)
from skyrl_train.algorithms.dynamic_sampling import (
    is_learned_flat_step,
    loss_rows,
    plan_filter,
    plan_replace,
    trajectory_indices,
    varying_groups,
)
from skyrl_train.config.schema import PPOConfig
from skyrl_train.dataset.batch import select_rows
from skyrl_train.dataset.preprocess import convert_to_training_batch
from skyrl_train.dataset.prompts import PromptDatasets, load_datasets, sample_step
from skyrl_train.generators.base import GeneratorInput, GeneratorOutput, concat_outputs
from skyrl_train.generators.gym_generator import GymGenerator
from skyrl_train.generators.rendering import ChatTemplateRenderer
from skyrl_train.runs.checkpoint import (
    DRIVER_FILE,
    begin_save,
    commit_save,
    prune_checkpoints,
    verify_checkpoint,
)
from skyrl_train.runs.export import export_due, export_name, export_root
from skyrl_train.runs.folder import CHECKPOINTS_DIR
from skyrl_train.trainer import served_weights
from skyrl_train.trainer.engine_clients import ClientOptions, make_client
from skyrl_train.trainer.rollout_dumps import RolloutDumper
from skyrl_train.utils.durable import write_file
from skyrl_train.utils.tracking import MetricsTracker, format_metrics_line

logger = logging.getLogger(__name__)

LINE_KEYS = (
    ("reward/mean", "reward"),
    ("reward/success_rate", "success"),
    ("eval/reward_mean", "eval_reward"),
    ("eval/success_rate", "eval_success"),
    ("policy/entropy", "entropy"),
    ("policy/kl_to_ref", "kl_ref"),
    ("advantage/zero_variance_group_frac", "zero_var"),
    ("policy/clip_fraction", "clip_frac"),
    ("response_length/mean", "resp_len"),
    ("generate/mean_turns", "turns"),
    ("r3/router_agreement_native", "agree_native"),
    ("r3/router_agreement_trained", "agree_trained"),
    ("r2/router_agreement_update", "agree_r2"),
    ("mismatch_trained/mean_abs_logp_diff", "dlogp_mean"),
    ("mismatch_trained/max_abs_logp_diff", "dlogp_max"),
    ("mismatch_trained/k3_kl", "k3"),
    ("mismatch_trained/frac_abs_logp_diff_gt_ln2", "frac_gt_ln2"),
    ("timing/generate_s", "t_gen"),
    ("timing/collate_s", "t_collate"),
    ("timing/train_s", "t_train"),
    ("timing/sync_s", "t_sync"),
    ("served_weights/median_abs_logp_diff", "served_dlogp"),
    ("async/staleness_max", "stale_max"),
)


class GRPOLoop:
    """Drives one run against started server URLs and a ``PolicyGroup`` (or any object
    with its async ``train``/``push_weights``/``save_checkpoint``/``load_checkpoint``)."""

    def __init__(
        self,
        cfg: PPOConfig,
        *,
        tokenizer: Any,
        server_urls: list[str],
        policy: Any,
        pad_token_id: int,
        api_key: str | None = None,
        datasets: PromptDatasets | None = None,
        client_options: ClientOptions | None = None,
        vocab_size: int | None = None,
        num_experts: int | None = None,
    ) -> None:
        """``datasets``: prompts loaded (and checked) by the launch before Ray started;
        None loads them here (``load_datasets``). ``client_options``: how generation
        clients are made (``engine_clients.make_client``); None: the config's backend
        with ``api_key``, which a vLLM server needs more than (``ClientOptions.for_run``).
        ``vocab_size``: the model's, the widest kept set top-p alone can have.
        ``num_experts``: the model's, the width of the rollout dumps' expert load."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.server_urls = server_urls
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size
        self.num_experts = num_experts
        self._dumper: RolloutDumper | None = None
        """Made per ``run``, which knows the step it starts after."""
        self.api_key = api_key
        self.client_options = client_options or ClientOptions(
            backend=cfg.generator.inference_engine.backend, api_key=api_key
        )
        self.run_dir = Path(cfg.trainer.run_dir)
        self.datasets = datasets if datasets is not None else load_datasets(cfg)
        self.version = 0
        self._generators: dict[tuple[bool, tuple[int, ...]], GymGenerator] = {}
        """Holding the clients keeps their ids unique while they key a generator."""
        """The policy version the servers hold: the last step whose weights were pushed."""
        self._probe_ids: list[list[int]] | None = None
        """The served-weights check's prompts, rendered at its first use."""
        self._version_changed: asyncio.Condition | None = None
        """Made per ``run``: asyncio primitives bind to the event loop that first uses them."""

    # ---- the run ---------------------------------------------------------------------

    async def run(self, *, start_step: int = 0) -> list[dict[str, float]]:
        t = self.cfg.trainer
        # Lines of steps after start_step (left by the run this one resumes) are dropped.
        tracker = MetricsTracker(
            self.run_dir, trackers=self.cfg.logging.trackers, start_step=start_step
        )
        self._dumper = RolloutDumper(
            self.run_dir,
            count=self.cfg.logging.dump_rollouts,
            tokenizer=self.tokenizer,
            group_size=self.cfg.generator.n_samples_per_prompt,
            start_step=start_step,
            num_experts=self.num_experts,
        )
        clients = [make_client(url, self.client_options) for url in self.server_urls]
        bar = tqdm(
            total=t.num_steps,
            initial=start_step,
            desc="GRPO steps",
            disable=not self.cfg.logging.progress_bar,
        )
        history = []
        # The servers hold version start_step (the launch pushed it); each step's push
        # makes it that step's number.
        self.version = start_step
        self._version_changed = asyncio.Condition()
        steps = range(start_step + 1, t.num_steps + 1)
        rollouts = self._rollouts_ahead(steps, clients) if t.fully_async.enabled else None
        try:
            if self._weights_check_due(start_step, start_step=start_step):
                # The launch's push: a transport or engine that ignores weights fails
                # here, before any rollout is trained on.
                await self.verify_served_weights(clients, policy_version=start_step)
            for step in steps:
                started = time.perf_counter()
                if rollouts is None:
                    rollout = await self.rollout(step, clients)
                else:
                    rollout = await rollouts.next()
                    waited = time.perf_counter() - started
                metrics = await self.learn(step, rollout)
                if self._weights_check_due(step, start_step=start_step):
                    metrics.update(await self.verify_served_weights(clients, policy_version=step))
                # The step's wall time: generation included when it ran in line, only the
                # wait for it when it ran ahead (fully async).
                metrics["timing/step_s"] = time.perf_counter() - started
                if rollouts is not None:
                    metrics["timing/wait_rollout_s"] = waited
                if t.eval_interval and (step % t.eval_interval == 0 or step == t.num_steps):
                    metrics.update(await self.evaluate(clients, step=step))
                tracker.log(step, metrics)
                history.append(metrics)
                bar.update(1)
                # INFO, so it reaches the job log file too; the launch's console handler
                # prints it bare through tqdm.write, above the progress bar.
                logger.info(format_metrics_line(step, metrics, LINE_KEYS))
                if t.ckpt_interval and step % t.ckpt_interval == 0:
                    await self.save_checkpoint(step)
                if export_due(step, interval=t.hf_save_interval, num_steps=t.num_steps):
                    await self.save_hf_export(step)
        finally:
            if rollouts is not None:
                await rollouts.close()
            bar.close()
            tracker.close()
            await asyncio.gather(*(c.close() for c in clients))
        return history

    def _weights_check_due(self, step: int, *, start_step: int) -> bool:
        interval = self.cfg.generator.inference_engine.verify_weights_interval
        return served_weights.is_due(step, interval=interval, start_step=start_step)

    async def verify_served_weights(
        self, clients: list[Any], *, policy_version: int
    ) -> dict[str, float]:
        """Every engine serves the weights of ``policy_version`` (``served_weights.py``);
        raises ``ServedWeightsError`` naming the engine and its worst token."""
        started = time.perf_counter()
        if self._probe_ids is None:
            # The first training prompts as the generator renders them: probes from the
            # distribution the run samples, the same ones at every check.
            renderer = ChatTemplateRenderer(self.tokenizer)
            self._probe_ids = served_weights.probe_prompts(
                renderer.initial(task.prompt) for task in self.datasets.train
            )
        eng, mode = self.cfg.generator.inference_engine, self.cfg.trainer.policy.routing_replay
        checks = await served_weights.check_served_weights(
            clients,
            self.server_urls,
            self.policy.score,
            prompts=self._probe_ids,
            pad_token_id=self.pad_token_id,
            policy_version=policy_version,
            tolerance=eng.verify_weights_tolerance,
            # Engine routes replayed: the bound then compares weights, not routing.
            routes=eng.enable_return_routed_experts and mode.enabled,
        )
        metrics = served_weights.check_metrics(checks)
        metrics["timing/verify_weights_s"] = time.perf_counter() - started
        logger.info(
            "served weights of policy version %d: |served - trainer| logprob median %.4f, "
            "mean %.4f (worst engine), worst token %.4f",
            policy_version,
            metrics["served_weights/median_abs_logp_diff"],
            metrics["served_weights/mean_abs_logp_diff"],
            metrics["served_weights/max_abs_logp_diff"],
        )
        return metrics

    def _rollouts_ahead(self, steps: range, clients: list[Any]) -> _RolloutsAhead:
        """Fully async: a task generating the steps' rollouts in order, each as soon as
        the servers' policy is recent enough for it (``max_staleness_steps``)."""
        bound = self.cfg.trainer.fully_async.max_staleness_steps

        async def produce(queue: asyncio.Queue[Rollout]) -> None:
            for step in steps:
                # Step k trains version k-1; its oldest turn may be `bound` versions older.
                await self._wait_for_version(step - 1 - bound)
                await queue.put(await self.rollout(step, clients))

        return _RolloutsAhead(produce, maxsize=bound)

    async def _wait_for_version(self, version: int) -> None:
        assert self._version_changed is not None, "run() makes it"
        async with self._version_changed:
            await self._version_changed.wait_for(lambda: self.version >= version)

    async def _set_version(self, version: int) -> None:
        if version < self.version:
            raise RuntimeError(f"policy version: expected >= {self.version}, got {version}")
        self.version = version
        if self._version_changed is not None:
            async with self._version_changed:
                self._version_changed.notify_all()

    async def rollout(self, step: int, clients: list[Any]) -> Rollout:
        """Step ``step``'s trajectories (dynamic sampling included) and the signals that
        describe the policy's own samples."""
        n = self.cfg.generator.n_samples_per_prompt
        started = time.perf_counter()
        tasks, output = await self._generate(step, clients, round=0)
        # Reward, success and flat-group share describe the policy's own samples (the
        # first round), not the batch dynamic sampling trains on.
        signals: dict[str, float] = {}
        if n >= 2:  # with one sample a prompt every group is trivially flat
            signals["advantage/zero_variance_group_frac"] = zero_variance_group_fraction(
                torch.as_tensor(output.rewards), contiguous_groups(len(output.rewards), n)
            )
        trained_on = await self._dynamic_sampling(step, clients, output, signals)
        return Rollout(tasks, output, trained_on, signals, time.perf_counter() - started)

    async def learn(self, step: int, rollout: Rollout) -> dict[str, float]:
        """Train on ``rollout`` and push the new weights as policy version ``step``."""
        cfg = self.cfg
        n = cfg.generator.n_samples_per_prompt
        started = time.perf_counter()
        batch = convert_to_training_batch(rollout.trained_on, pad_token_id=self.pad_token_id)
        algo = cfg.trainer.algorithm
        advantages = compute_advantages(
            algo.advantage_estimator,
            batch.rewards,
            batch.loss_mask,
            contiguous_groups(batch.batch_size, n),
            token_rewards=batch.token_rewards,
            norm_by_std=algo.norm_adv_by_std_in_grpo,
            eps=algo.advantage_eps,
        )
        batch.loss_rows = loss_rows(
            batch.rewards.tolist(),
            n,
            estimator=algo.advantage_estimator,
            zero_variance_filter=algo.zero_variance_filter,
            skip_flat_steps=algo.skip_flat_steps,
        )
        collated = time.perf_counter()
        if self._dumper is not None and self._dumper.enabled:
            await self._dump_train(step, rollout, batch, advantages)
        dumped = time.perf_counter()
        # Raises NonFiniteError on a NaN/inf loss, grad norm or weight: nothing is pushed.
        metrics = dict(await self.policy.train(batch, advantages, step=step))
        trained = time.perf_counter()
        metrics.update(
            await self.policy.push_weights(
                self.server_urls, api_key=self.api_key, policy_version=step
            )
        )
        await self._set_version(step)
        synced = time.perf_counter()
        metrics.update(rollout.signals)
        metrics.update(_rollout_metrics(rollout.output))
        metrics.update(_staleness_metrics(rollout.trained_on, trained_version=step - 1))
        sources = [task.data_source for task in rollout.tasks for _ in range(n)]
        if len(set(sources)) > 1:
            metrics.update(_reward_by_source("reward", sources, rollout.output.rewards))
        metrics.update(
            {
                "timing/generate_s": rollout.generate_s,
                "timing/collate_s": collated - started,
                "timing/dump_s": dumped - collated,
                "timing/train_s": trained - dumped,
                "timing/sync_s": synced - trained,
            }
        )
        return metrics

    async def _generate(
        self, step: int, clients: list[Any], *, round: int
    ) -> tuple[list[skyrl_gym.Task], GeneratorOutput]:
        """One generation round of ``step``: its prompts and request seeds derive from
        (seed, step, round), so every round is reproducible on resume."""
        cfg = self.cfg
        tasks = sample_step(
            self.datasets.train,
            batch_size=cfg.trainer.train_batch_size,
            seed=cfg.trainer.seed,
            step=step,
            round=round,
        )
        seed = _step_seed(cfg.trainer.seed, step) + round * _ROUND_SEED_STRIDE
        output = await self._generator(clients, evaluation=False).generate(
            self._input(tasks, cfg.generator.n_samples_per_prompt), seed=seed
        )
        return tasks, output

    def _generator(self, clients: list[Any], *, evaluation: bool) -> GymGenerator:
        """One generator per (clients, train or eval) for the run: its sampling
        parameters are checked once, not on every round."""
        key = (evaluation, tuple(map(id, clients)))
        if key not in self._generators:
            self._generators[key] = GymGenerator(
                clients,
                self.tokenizer,
                self.cfg.generator,
                evaluation=evaluation,
                vocab_size=self.vocab_size,
                env_configs=self.cfg.environment.skyrl_gym,
                # A second, transient bar over trajectories inside each step's rollout.
                progress=self.cfg.logging.progress_bar,
            )
        return self._generators[key]

    async def _dynamic_sampling(
        self,
        step: int,
        clients: list[Any],
        first: GeneratorOutput,
        metrics: dict[str, float],
    ) -> GeneratorOutput:
        """The batch to train on (``trainer.algorithm.dynamic_sampling``), still
        ``train_batch_size`` whole groups; adds ``dynamic_sampling/*`` to ``metrics``."""
        ds = self.cfg.trainer.algorithm.dynamic_sampling
        n = self.cfg.generator.n_samples_per_prompt
        if ds.type is None:
            return first
        num_groups = self.cfg.trainer.train_batch_size
        if ds.type == "replace":
            plan = plan_replace(
                varying_groups(first.rewards, n),
                min_replace_ratio=ds.min_replace_ratio,
                rng=random.Random(f"{self.cfg.trainer.seed}:replace:{step}"),
            )
            chosen = first.take(trajectory_indices(plan, n))
            rounds = 1
        elif ds.type == "filter_flat_steps" and not is_learned_flat_step(first.rewards, n):
            chosen, rounds = first, 1
        else:
            outputs, flags = [first], [varying_groups(first.rewards, n)]
            while len(outputs) < ds.max_sample_batches and sum(map(sum, flags)) < num_groups:
                _, more = await self._generate(step, clients, round=len(outputs))
                outputs.append(more)
                flags.append(varying_groups(more.rewards, n))
            picks = plan_filter(flags, num_groups)
            chosen = concat_outputs([outputs[r].take(trajectory_indices([g], n)) for r, g in picks])
            rounds = len(outputs)
        varying = varying_groups(chosen.rewards, n)
        metrics["dynamic_sampling/rounds"] = float(rounds)
        metrics["dynamic_sampling/varying_group_frac"] = sum(varying) / len(varying)
        return chosen

    async def _dump_train(
        self, step: int, rollout: Rollout, batch: Any, advantages: torch.Tensor
    ) -> None:
        """The step's first ``logging.dump_rollouts`` trajectories, with the trainer's
        view of them before the update (``rollout_dumps``)."""
        assert self._dumper is not None
        rows = self._dumper.rows(batch.batch_size)
        inspect = getattr(self.policy, "inspect", None)  # a stand-in policy may lack it
        inspection = None
        if inspect is not None:
            inspection = await inspect(select_rows(batch, torch.tensor(rows)))
        n = self.cfg.generator.n_samples_per_prompt
        own = rollout.trained_on is rollout.output  # else dynamic sampling mixed rounds
        self._dumper.write_train(
            step,
            rollout.trained_on,
            advantages=advantages,
            inspection=inspection,
            prompt_width=batch.sequences.shape[1] - batch.num_actions,
            sources=_sources(rollout.tasks, n) if own else None,
        )

    async def evaluate(self, clients: list[Any], *, step: int | None = None) -> dict[str, float]:
        """``eval_n_samples_per_prompt`` rollouts (greedy by default) of every held-out
        prompt: the mean reward (and per data source) and, when the environments report
        ``solved``, the success rate. ``step``: the step it follows, for the rollout
        dumps (None: not dumped)."""
        tasks = self.datasets.eval
        n = self.cfg.generator.eval_n_samples_per_prompt
        output = await self._generator(clients, evaluation=True).generate(
            self._input(tasks, n), seed=0
        )
        metrics = {"eval/reward_mean": float(np.mean(output.rewards))}
        solved = success_rate(output.solved or [])
        if solved is not None:
            metrics["eval/success_rate"] = solved
        sources = [task.data_source for task in tasks for _ in range(n)]
        metrics.update(_reward_by_source("eval/reward_mean", sources, output.rewards))
        if step is not None and self._dumper is not None and self._dumper.enabled:
            self._dumper.write_eval(step, output, group_size=n, sources=_sources(tasks, n))
        return metrics

    def _input(self, tasks: list[skyrl_gym.Task], n: int) -> GeneratorInput:
        repeated = [task for task in tasks for _ in range(n)]
        return GeneratorInput(
            prompts=[task.prompt for task in repeated],
            env_names=[task.env_name for task in repeated],
            env_extras=[task.env_extras for task in repeated],
        )

    # ---- checkpoints -------------------------------------------------------------------

    async def save_checkpoint(self, step: int) -> Path:
        """Write ``checkpoints/step_NNNNNN`` whole or not at all, then delete the oldest
        beyond ``trainer.max_ckpts_to_keep``; returns the committed folder."""
        root = self.run_dir / CHECKPOINTS_DIR
        folder = begin_save(root, step=step)
        try:
            await self.policy.save_checkpoint(str(folder))
            driver = {"step": step, "world_size": self.cfg.trainer.placement.num_trainers}
            write_file(folder / DRIVER_FILE, json.dumps(driver).encode())
            final = commit_save(folder, step=step)
        except Exception:
            # Best effort (a rank may still be writing): what is left is a temp folder,
            # never resumed from and removed by the next save.
            shutil.rmtree(folder, ignore_errors=True)
            raise
        prune_checkpoints(root, keep=self.cfg.trainer.max_ckpts_to_keep, current_step=step)
        return final

    async def save_hf_export(self, step: int) -> Path:
        """Write ``<export_path>/global_step_N`` as a Hugging Face folder, whole or not at
        all (``runs/export.py``); returns it."""
        t = self.cfg.trainer
        final = export_root(t.export_path, t.run_dir) / export_name(step)
        started = time.perf_counter()
        folder, written = await self.policy.export_hf(final, step=step, run_dir=t.run_dir)
        logger.info(
            "exported step %d to %s (%d tensors, %.1f MiB) in %.1f s",
            step,
            folder,
            written.tensors,
            written.total_bytes / 2**20,
            time.perf_counter() - started,
        )
        return folder

    async def load_checkpoint(self, folder: str | Path) -> int:
        """Restores the policy from ``folder`` and returns the step it was taken at.

        Checks the file set and sizes against the manifest; the launch already hashed
        every file (``verify_resume``) before Ray started, so that pass is not repeated.
        """
        found = verify_checkpoint(folder, hash_files=False)
        await self.policy.load_checkpoint(str(found.folder))
        return found.step


_ROUND_SEED_STRIDE = 7_919
"""Request seeds of a step's extra dynamic-sampling rounds sit this far from its first."""


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**31 - 1)


def _sources(tasks: list[skyrl_gym.Task], n: int) -> list[tuple[str, str]]:
    """(data source, environment) of each trajectory of ``tasks`` sampled ``n`` times."""
    return [(task.data_source, task.env_name) for task in tasks for _ in range(n)]


def _reward_by_source(prefix: str, sources: list[str], rewards: list[float]) -> dict[str, float]:
    """``{prefix}/{source}``: the mean reward of each data source's trajectories."""
    by_source: dict[str, list[float]] = {}
    for source, reward in zip(sources, rewards, strict=True):
        by_source.setdefault(source, []).append(float(reward))
    return {f"{prefix}/{source}": float(np.mean(values)) for source, values in by_source.items()}


def _rollout_metrics(output: GeneratorOutput) -> dict[str, float]:
    rewards = np.asarray(output.rewards, dtype=np.float64)
    lengths = np.asarray([len(r) for r in output.response_ids], dtype=np.float64)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/max": float(rewards.max()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
    }
    solved = success_rate(output.solved or [])
    if solved is not None:  # absent when no environment reports ``solved``
        metrics["reward/success_rate"] = solved
    metrics.update({k: float(v) for k, v in output.rollout_metrics.items()})
    return metrics


@dataclasses.dataclass
class Rollout:
    """One step's generation, ready to learn from."""

    tasks: list[skyrl_gym.Task]
    output: GeneratorOutput
    """The policy's own samples (the first round)."""
    trained_on: GeneratorOutput
    """What the step trains on (dynamic sampling may have replaced or added groups)."""
    signals: dict[str, float]
    generate_s: float


class _RolloutsAhead:
    """A producer task filling a bounded queue; ``next`` re-raises the producer's
    failure, ``close`` cancels it (Ctrl-C or an error in a step stop generation too)."""

    def __init__(self, produce: Any, *, maxsize: int) -> None:
        self.queue: asyncio.Queue[Rollout] = asyncio.Queue(maxsize=maxsize)
        self.task = asyncio.get_running_loop().create_task(produce(self.queue))

    async def next(self) -> Rollout:
        getter = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({getter, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        self.task.result()  # raises the producer's exception
        raise RuntimeError("rollouts: expected one more step, got the producer's end")

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def _staleness_metrics(output: GeneratorOutput, *, trained_version: int) -> dict[str, float]:
    """How many versions older than the trained policy each trajectory's oldest turn
    is, and how many trajectories a weight push landed in (fully async)."""
    if output.policy_versions is None:
        return {}
    oldest = np.asarray([v[0] for v in output.policy_versions], dtype=np.float64)
    spans = [v[1] != v[0] for v in output.policy_versions]
    staleness = trained_version - oldest
    return {
        "async/staleness_mean": float(staleness.mean()),
        "async/staleness_max": float(staleness.max()),
        "async/spanning_push_frac": float(np.mean(spans)),
        "async/trained_version": float(trained_version),
    }
