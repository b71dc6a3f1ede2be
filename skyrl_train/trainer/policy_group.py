"""``trainer.placement.num_trainers`` policy actors on Ray, driven as one policy.

The driver shards each collated batch by data-parallel rank and sends every actor only
its own shard (one ``ray.put`` per shard); all ranks train concurrently, since they
meet in collectives (gradient all-reduce, expert all-gather), and their metrics come
back as sums that the driver adds and divides once
(``data_parallel.combine_rank_metrics``). Weight export gathers experts over the EP
group, so every rank exports and only rank 0 pushes to the servers. Checkpoints hold one file per rank, written into the driver's temp folder
(``runs/checkpoint.py`` makes the folder appear whole or not at all), and the settings
that rebuild the ranks (``RUN_CONFIG_FILE``), so ``scripts/export_hf.py`` can. Hugging
Face exports are written the same way: rank 0 writes the weights into the driver's temp
folder, the others join the export's collectives (``runs/export.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from skyrl_train.config.compose import config_to_dict
from skyrl_train.config.schema import PPOConfig
from skyrl_train.config.strategy import backend_node
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.runs.checkpoint import RUN_CONFIG_FILE
from skyrl_train.runs.export import (
    DEFAULT_MAX_SHARD_BYTES,
    EXPORT_KEY,
    WeightFiles,
    begin_export,
    commit_export,
)
from skyrl_train.trainer.data_parallel import (
    ROWS_KEY,
    combine_rank_metrics,
    mini_batch_token_counts,
    shard_mini_batches,
)
from skyrl_train.trainer.policy import PolicyTrainer, RankInfo
from skyrl_train.trainer.rollout_dumps import Inspection
from skyrl_train.utils.durable import write_file
from skyrl_train.utils.ray_session import reserve_bundles


class PolicyGroup:
    """The policy actors of one run. ``place`` starts them, ``setup`` builds the
    models (joining torch.distributed), ``kill`` removes them; a group that failed
    half-way through setup can still be killed."""

    def __init__(self, cfg: PPOConfig, actors: list[Any], *, model_folder: str = "") -> None:
        self.cfg = cfg
        self.actors = actors
        self.model_folder = model_folder
        """The checkpoint folder the ranks loaded: exports copy its config and tokenizer."""
        self.ranks: list[RankInfo] = []
        self._rendezvous = ""
        self.placement_group: Any = None
        """The ranks' Ray placement group (``trainer.placement.strategy``), or None."""
        self.received_rows: list[int] = []
        """Rows each rank reported training on in the last ``train`` call (by rank)."""

    @classmethod
    def place(cls, cfg: PPOConfig, *, checkpoint: str, pad_token_id: int) -> PolicyGroup:
        """One actor per trainer rank, ``cpus_per_trainer`` CPUs each (not built yet),
        each to load the model folder ``checkpoint``; with ``trainer.placement.strategy``
        each in a bundle of one placement group reserved first (``rank_bundles``)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        placement = cfg.trainer.placement
        group = None
        bundles = list(range(placement.num_trainers))
        if placement.strategy is not None:
            group = reserve_bundles(
                [{"CPU": placement.cpus_per_trainer}] * placement.num_trainers,
                strategy=placement.strategy,
                key="trainer.placement.strategy",
                timeout_s=placement.timeout_s,
                timeout_key="trainer.placement.timeout_s",
            )
            bundles = rank_bundles(
                ray.util.placement_group_table(group)["bundles_to_node_id"],
                first_node=ray.get_runtime_context().get_node_id(),
            )
        remote = ray.remote(PolicyTrainer)
        actors = []
        for bundle in bundles:
            options: dict[str, Any] = {"num_cpus": placement.cpus_per_trainer}
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=bundle
                )
            actors.append(
                remote.options(**options).remote(
                    cfg, checkpoint=checkpoint, pad_token_id=pad_token_id
                )
            )
        placed = cls(cfg, actors, model_folder=checkpoint)
        placed.placement_group = group
        return placed

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @property
    def dp_size(self) -> int:
        return self.ranks[0].dp_size

    def setup(self) -> list[RankInfo]:
        """Rendezvous at rank 0's node and build every rank's worker concurrently
        (``init_process_group`` blocks until all ranks have joined)."""
        return self.finish_setup(self.start_setup())

    def start_setup(self) -> list[Any]:
        """Start building every rank's worker and return without waiting for it (only
        for rank 0's rendezvous address): a launch builds the ranks while its servers
        load (``main_base``)."""
        import ray

        init_method = ray.get(self.actors[0].rendezvous.remote())
        self._rendezvous = init_method
        return [
            actor.setup.remote(rank=rank, world_size=self.world_size, init_method=init_method)
            for rank, actor in enumerate(self.actors)
        ]

    def finish_setup(self, refs: list[Any]) -> list[RankInfo]:
        """Wait for the builds ``start_setup`` began; the ranks' ``RankInfo``."""
        import ray

        # Raise as soon as one rank fails: the others wait in init_process_group for
        # it (gloo's default timeout is 30 minutes) until the teardown kills them.
        pending = refs
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
        self.ranks = list(ray.get(refs))
        return self.ranks

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._rendezvous.startswith("file://"):
            # Rank 0 made the folder on this machine (a file rendezvous is local only).
            shutil.rmtree(Path(self._rendezvous.removeprefix("file://")).parent, True)

    # ---- training -------------------------------------------------------------------

    async def train(
        self, batch: TrainingBatch, advantages: torch.Tensor, *, step: int
    ) -> dict[str, float]:
        """One GRPO policy update over ``batch`` (advantages computed on the full batch).

        Raises the first rank's ``NonFiniteError`` when a loss, grad norm or weight went
        NaN/inf: the driver then never pushes the weights (``finite.py``).
        """
        import ray

        if not self.ranks:
            raise RuntimeError("PolicyGroup: call setup() first")
        t = self.cfg.trainer
        mini = t.policy_mini_batch_size * self.cfg.generator.n_samples_per_prompt
        full = dataclasses.replace(batch, advantages=advantages)
        shards = [
            ray.put(shard)
            for shard in shard_mini_batches(full, mini_batch_size=mini, dp_size=self.dp_size)
        ]
        tokens = mini_batch_token_counts(full, mini_batch_size=mini)
        per_rank = await _all(
            actor.train.remote(shards[info.dp_rank], step=step, mini_batch_tokens=tokens)
            for actor, info in zip(self.actors, self.ranks, strict=True)
        )
        self.received_rows = [int(metrics[ROWS_KEY]) for metrics in per_rank]
        # Ranks that share a dp rank (tensor/pipeline peers) trained the same rows; the
        # last pipeline stage ran the loss, so its metrics are the complete ones.
        seen = {
            info.dp_rank: metrics
            for info, metrics in zip(self.ranks, per_rank, strict=True)
            if info.is_last_stage
        }
        return combine_rank_metrics([seen[r] for r in sorted(seen)])

    async def score(self, batch: TrainingBatch) -> torch.Tensor:
        """The policy's logprobs ``[B, R]`` of ``batch``'s responses: every rank scores
        the whole (small) batch, since experts and stages meet in collectives."""
        import ray

        shared = ray.put(batch)
        per_rank = await _all(actor.score.remote(shared) for actor in self.actors)
        return next(logprobs for logprobs in per_rank if logprobs is not None)

    async def inspect(self, batch: TrainingBatch) -> Inspection:
        """The trainer's view of ``batch``'s rows for the rollout dumps
        (``PolicyTrainer.inspect``): every rank runs it, as ``score``."""
        import ray

        shared = ray.put(batch)
        per_rank = await _all(actor.inspect.remote(shared) for actor in self.actors)
        return next(found for found in per_rank if found is not None)

    async def push_weights(
        self, urls: list[str], *, api_key: str | None = None, policy_version: int | None = None
    ) -> dict[str, float]:
        """Rank 0 sends the weights to ``urls`` (the others join the export); with
        ``policy_version`` the servers switch to that version atomically."""
        stats = await _all(
            actor.push_weights.remote(
                urls if rank == 0 else [], api_key=api_key, policy_version=policy_version
            )
            for rank, actor in enumerate(self.actors)
        )
        return stats[0]

    # ---- checkpoints ------------------------------------------------------------------

    async def save_checkpoint(self, folder: str) -> None:
        await _all(actor.save_checkpoint.remote(folder) for actor in self.actors)
        write_file(Path(folder) / RUN_CONFIG_FILE, run_config_record(self.cfg))

    async def export_hf(
        self,
        final: Path,
        *,
        step: int | None,
        key: str = EXPORT_KEY,
        run_dir: str | Path | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> tuple[Path, WeightFiles]:
        """Write the policy's weights as a Hugging Face folder at ``final``, whole or not
        at all (``runs/export.py``); returns it and what rank 0 wrote."""
        temp = begin_export(final, key=key)
        try:
            written = await _all(
                actor.export_hf.remote(
                    str(temp),
                    self.model_folder,
                    write=rank == 0,
                    max_shard_bytes=max_shard_bytes,
                )
                for rank, actor in enumerate(self.actors)
            )
            source = Path(self.model_folder)
            done = commit_export(temp, final, source=source, step=step, run_dir=run_dir, key=key)
        except BaseException:
            # Best effort (a rank may still be writing): a temp folder left behind is
            # never read as an export and the next export removes it.
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return done, written[0]

    async def load_checkpoint(self, folder: str) -> None:
        await _all(actor.load_checkpoint.remote(folder) for actor in self.actors)


def rank_bundles(bundle_nodes: Mapping[int, str], *, first_node: str) -> list[int]:
    """The placement-group bundle of each rank, given each bundle's node: the ranks of
    one node consecutive, since Megatron builds tensor and expert groups from
    consecutive ranks and those collectives then stay inside a node; ``first_node``
    (the driver's) first, so that rank 0, which writes the Hugging Face export into the
    driver's folder, runs beside it wherever Ray put a bundle there."""
    order = {first_node: 0}
    for index in sorted(bundle_nodes):
        order.setdefault(bundle_nodes[index], len(order))
    return sorted(bundle_nodes, key=lambda index: (order[bundle_nodes[index]], index))


def run_config_record(cfg: PPOConfig) -> bytes:
    """``RUN_CONFIG_FILE``'s bytes: every setting that builds the policy ranks, so that
    ``parse_config`` of them builds the ranks the run had (``scripts/export_hf.py``):
    ``model``, ``trainer.seed``, ``trainer.strategy``, ``trainer.placement``,
    ``trainer.weight_sync``, the policy's ``routing_replay`` and ``optimizer_config``
    and the backend's node (``megatron_config`` or ``fsdp_config``), and the two keys of
    the trainer's temperature (``trainer_temperature``); its paths made absolute. Only
    these: ``ray.runtime_env`` may hold secrets.

    The replay mode is recorded because the Megatron worker refuses some settings only
    under replay: a record without it read back as replay on, and the export of a
    replay-off run that used one was refused."""
    full = config_to_dict(cfg)
    node, _value = backend_node(cfg.trainer)
    model = full["model"]
    for key in ("path", "cache_dir"):  # the export may run from another folder
        if model.get(key):
            model[key] = str(Path(model[key]).resolve())
    trainer = full["trainer"]
    policy = trainer["policy"]
    sampling_temperature = full["generator"]["sampling_params"]["temperature"]
    record = {
        "model": model,
        # trainer_temperature's two keys: the workers score at that temperature.
        "generator": {"sampling_params": {"temperature": sampling_temperature}},
        "trainer": {
            "seed": trainer["seed"],
            "strategy": trainer["strategy"],
            "placement": trainer["placement"],
            "weight_sync": trainer["weight_sync"],
            "algorithm": {"temperature": trainer["algorithm"]["temperature"]},
            "policy": {
                "optimizer_config": policy["optimizer_config"],
                "routing_replay": policy["routing_replay"],
                node: policy[node],
            },
        },
    }
    return json.dumps(record, indent=1).encode() + b"\n"


async def _all(refs: Any) -> list[Any]:
    # gather raises on the first failure; ranks still blocked in a collective with
    # the failed one are killed by the launch's teardown, not waited for.
    return list(await asyncio.gather(*refs))
