"""The policy side of one GRPO step, run inside the trainer actor.

Per batch: one forward as the trainer will train (routes replayed when R3 is on) gives
the old logprobs, the router agreement as trained and the rollout-vs-trainer
logprob mismatch; with R3 on, a second forward without replay measures what R3
removes (the trainer's native routing against the rollout's). Then PPO-clip updates
over mini-batches, then weights go back to the inference servers.

With several ranks each one runs this on its own shard of the batch
(``policy_group.PolicyGroup`` fans the calls out and combines the metrics).

Kept whole: which forward each metric and each log-prob comes from (replayed or native,
before or during the update) is what a reviewer checks, and it reads in one order here,
one method per pass; which pass replays or captures which routes is decided once per
step (``replay_plan.ReplayPlan``), and the loss (``policy_loss.py``), advantages and
rank files live in their own modules.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from inference.models.checkpoint import inspect_checkpoint
from skyrl_train.algorithms import (
    MetricSums,
    OffPolicyCorrection,
    entropy_coefficient,
    kl_penalty,
    logprob_mismatch,
    mean_token_entropy,
    scheduled_entropy_coef,
)
from skyrl_train.algorithms.token_mean import microbatch_denominator
from skyrl_train.config.schema import PPOConfig
from skyrl_train.dataset.batch import (
    TrainingBatch,
    slice_batch,
    training_loss_mask,
    trajectory_ids,
)
from skyrl_train.runs.export import WeightFiles, write_weights
from skyrl_train.runs.rank_contract import ParallelLayout
from skyrl_train.runs.rank_file import checkpoint_file, save_rank_state
from skyrl_train.runs.resume import rank_checkpoint, restore_rank
from skyrl_train.trainer.data_parallel import ROWS_KEY
from skyrl_train.trainer.finite import require_finite, require_finite_weights
from skyrl_train.trainer.microbatch_plan import microbatch_plan
from skyrl_train.trainer.policy_loss import policy_loss_fn
from skyrl_train.trainer.replay_plan import ReplayPlan
from skyrl_train.trainer.rollout_dumps import Inspection
from skyrl_train.trainer.weight_sync import WeightSyncer
from skyrl_train.utils.distributed import collective_device
from skyrl_train.utils.ray_session import rendezvous_url
from skyrl_train.workers.base import ForwardResult, PolicyWorker, RankInfo
from skyrl_train.workers.microbatches import MicrobatchPlan

logger = logging.getLogger(__name__)


def checkpoint_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's fp32 weights in the engine's layout, one tensor at a time.

    Read through transformers, so the names are the live modules' whatever the files
    on disk spell (transformers 5 renames some families' legacy tensor names on load).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, local_files_only=True
    )
    for name, param in model.named_parameters():
        yield name, param.detach()


class PolicyTrainer:
    """One trainer rank's policy worker (``workers.base.PolicyWorker``, whichever
    backend built it); every method is a Ray actor call.

    Construction only stores the config; ``setup`` joins torch.distributed (when
    ``world_size > 1``) and builds the model, so rank 0 can first pick the rendezvous
    on its own node (``rendezvous``).
    """

    def __init__(
        self, cfg: PPOConfig, *, checkpoint: str, pad_token_id: int, num_threads: int = 1
    ) -> None:
        torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.checkpoint = checkpoint
        """The model folder the run trains (``config.model_source.model_checkpoint``)."""
        self.pad_token_id = pad_token_id
        self.worker: PolicyWorker
        self.reference: dict[str, torch.Tensor] | None = None
        """This rank's initial parameters (``trainer.ref``); None when neither the KL
        metric nor the KL loss needs them."""
        self.info = RankInfo(rank=0, world_size=1, dp_rank=0, dp_size=1, ep_size=1)
        self.syncer = WeightSyncer.from_config(cfg.trainer.weight_sync)

    def rendezvous(self) -> str:
        """Where the other ranks meet rank 0 (``ray_session.rendezvous_url``); a method
        of rank 0's actor because it must run on rank 0's node."""
        return rendezvous_url()

    def setup(self, *, rank: int = 0, world_size: int = 1, init_method: str = "env://") -> RankInfo:
        """Join the process group and build the worker; returns this rank's place."""
        # Here, not at module import: the driver imports this module and must not load
        # a backend (workers/factory.py).
        from skyrl_train.workers.factory import build_worker

        if init_method.startswith("file://"):
            # Ranks that met through a local file talk over loopback too; gloo would
            # otherwise bind to whatever address the host name resolves to.
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        cfg = self.cfg
        self.worker = build_worker(
            cfg,
            architecture=inspect_checkpoint(self.checkpoint).architecture,
            checkpoint=self.checkpoint,
            pad_token_id=self.pad_token_id,
            rank=rank,
            world_size=world_size,
            init_method=init_method,
        )
        self.worker.load_weights(checkpoint_weights(self.checkpoint))
        if cfg.trainer.ref.log_kl or cfg.trainer.algorithm.use_kl_loss:
            # Taken before any resume (load_checkpoint comes later): the reference is
            # the run's starting point, so a resumed run measures the same KL.
            self.reference = self.worker.parameter_snapshot()
        self.info = self.worker.rank_info()
        return self.info

    # ---- one training step --------------------------------------------------------

    def train(
        self,
        batch: TrainingBatch,
        *,
        step: int,
        mini_batch_tokens: Sequence[float] | None = None,
    ) -> MetricSums:
        """Old logprobs, R3 metrics and PPO updates on this rank's shard.

        ``batch`` holds this rank's ``1/dp`` of every global mini-batch, in order
        (``data_parallel.shard_mini_batches``), with ``advantages`` set by the driver;
        it is left as it came (the passes below work on a copy).
        ``step``: the GRPO step, for ``NonFiniteError``'s message.
        ``mini_batch_tokens``: loss-active tokens of each *global* mini-batch (None:
        this shard's own counts, which is the same thing on one rank).

        Returns the metrics as sums (``MetricSums``: each mean's numerator and its own
        denominator), which the driver adds over ranks and divides once
        (``data_parallel.combine_rank_metrics``); read as a mapping they are this
        shard's values.

        Raises ``NonFiniteError`` on a NaN/inf loss, grad norm or parameter, so the
        driver never pushes such weights (``finite.py``).
        """
        t = self.cfg.trainer
        if batch.advantages is None:
            raise ValueError("advantages: expected [B, R] advantages set on the batch, got None")
        plan = ReplayPlan.decide(
            t.policy.routing_replay, rollout_routes=batch.routed_experts is not None
        )
        metrics = MetricSums()
        as_trained, entropy_sums = self._old_logprob_pass(batch, plan, metrics)
        update_batch = plan.update_batch(
            batch, old_logprobs=as_trained.logprobs, routes=as_trained.routes
        )
        ref_logprobs = self._reference_pass(update_batch, plan, as_trained.logprobs, metrics)
        if t.algorithm.use_kl_loss:
            update_batch.ref_logprobs = ref_logprobs
        entropy_coef = self._entropy_coef(*entropy_sums, step=step)
        if t.algorithm.use_entropy_loss:
            metrics.mean("policy/entropy_coef", entropy_coef, 1.0)
        metrics.merge(
            self._update(
                update_batch,
                plan=plan,
                mini_batch_tokens=mini_batch_tokens,
                step=step,
                entropy_coef=entropy_coef,
            )
        )
        # Each rank checks its own parameters: together they cover every expert shard.
        require_finite_weights(
            self.worker.named_parameters(), step=step, where=f"rank {self.info.rank}"
        )
        metrics.total(ROWS_KEY, float(batch.batch_size))
        return metrics

    def _old_logprob_pass(
        self, batch: TrainingBatch, plan: ReplayPlan, metrics: MetricSums
    ) -> tuple[ForwardResult, tuple[float, float]]:
        """The forward as the trainer will train (``plan.old_logprobs``), its metrics
        into ``metrics``: the entropy, the router agreements (trained and native) and the
        log-prob mismatches against the rollout. Returns the forward and this rank's
        (entropy sum, tokens), (0, 0) on a rank without logprobs."""
        micro = self._microbatches(batch, self.cfg.trainer.micro_forward_batch_size_per_gpu)
        as_trained = self.worker.forward(
            batch,
            micro_batch_size=micro,
            replay_routes=plan.old_logprobs.replay,
            capture_routes=plan.old_logprobs.capture,
            entropy=True,
            trajectory_ids=trajectory_ids(batch),
        )
        own_tokens = float(batch.loss_mask.sum())
        metrics.total("policy/num_tokens", own_tokens)
        entropy_sums = (0.0, 0.0)
        if as_trained.entropy is not None:
            # Over the policy's own tokens only (loss mask), not prompt or observations.
            entropy = mean_token_entropy(as_trained.entropy, batch.loss_mask)
            entropy_sums = (entropy * own_tokens, own_tokens)
            metrics.mean("policy/entropy", *entropy_sums)
        if plan.rollout_routes:
            native = self._native_forward(batch, plan, as_trained, micro)
            assert as_trained.routes is not None and native.routes is not None
            for name, routes in (("trained", as_trained.routes), ("native", native.routes)):
                got = self.worker.rollout_router_agreement(batch, routes)
                layers = float(got.num_token_layers)
                metrics.mean(
                    f"r3/router_agreement_{name}", got.agreement * layers, layers, empty=1.0
                )
            # Same mask, same batch: both agreements count the same token-layers.
            metrics.total("r3/num_token_layers", layers)
            if batch.rollout_logprobs is not None:
                metrics.merge(
                    logprob_mismatch(
                        native.logprobs, batch.rollout_logprobs, batch.loss_mask
                    ).to_metrics("mismatch_native")
                )
        if batch.rollout_logprobs is not None:
            metrics.merge(
                logprob_mismatch(
                    as_trained.logprobs, batch.rollout_logprobs, batch.loss_mask
                ).to_metrics("mismatch_trained")
            )
        return as_trained, entropy_sums

    def _reference_pass(
        self,
        batch: TrainingBatch,
        plan: ReplayPlan,
        logprobs: torch.Tensor,
        metrics: MetricSums,
    ) -> torch.Tensor | None:
        """The reference policy's logprobs of the update ``batch`` (its routes replayed as
        the updates will), with ``policy/kl_to_ref`` of the policy's ``logprobs`` into
        ``metrics``; None without a reference (``trainer.ref``)."""
        if self.reference is None:
            return None
        with self.worker.swapped_weights(self.reference):
            ref_logprobs = self.worker.forward(
                batch,
                micro_batch_size=self._microbatches(
                    batch, self.cfg.trainer.micro_forward_batch_size_per_gpu
                ),
                replay_routes=plan.update.replay,
                trajectory_ids=trajectory_ids(batch),
            ).logprobs
        # k3 KL(policy || initial policy) on the rollout's tokens, policy side as
        # trained: how far training has moved the policy.
        own_tokens = float(batch.loss_mask.sum())
        kl = float(kl_penalty(logprobs, ref_logprobs, batch.loss_mask))
        metrics.mean("policy/kl_to_ref", kl * own_tokens, own_tokens)
        return ref_logprobs

    def _microbatches(self, batch: TrainingBatch, micro_batch_size: int) -> MicrobatchPlan:
        """The worker's microbatches of ``batch``: ``micro_batch_size`` rows each, or under
        ``trainer.max_tokens_per_microbatch`` token-budget groups whose count every rank
        agrees in one all-reduce (``microbatch_plan.py``), so every rank calls this at the
        same point of a step."""
        return microbatch_plan(
            batch,
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=self.cfg.trainer.max_tokens_per_microbatch,
        )

    def _entropy_coef(self, entropy_sum: float, tokens: float, *, step: int) -> float:
        """The step's bonus coefficient: ``entropy_loss_coef`` on its schedule to
        ``entropy_loss_coef_end``, then scaled by ``entropy_target`` / ``entropy_ceiling``
        from the whole step's token mean entropy (this rank's ``entropy_sum`` over
        ``tokens``, summed over ranks): every rank trains with the same one. Ranks
        without logprobs (not the last pipeline stage) add (0, 0)."""
        t = self.cfg.trainer
        algo = t.algorithm
        coef = scheduled_entropy_coef(
            algo.entropy_loss_coef, end=algo.entropy_loss_coef_end, step=step, num_steps=t.num_steps
        )
        if algo.entropy_target is None and algo.entropy_ceiling is None:
            return coef
        sums = torch.tensor([entropy_sum, tokens], dtype=torch.float64, device=collective_device())
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # Ranks holding the same rows (tensor/pipeline/context copies) add them
            # alike, so the ratio is still the data-parallel batch's mean.
            torch.distributed.all_reduce(sums)
        mean = float(sums[0] / sums[1]) if float(sums[1]) else 0.0
        return entropy_coefficient(
            coef, target=algo.entropy_target, ceiling=algo.entropy_ceiling, entropy=mean
        )

    def _update(
        self,
        batch: TrainingBatch,
        *,
        plan: ReplayPlan,
        mini_batch_tokens: Sequence[float] | None,
        step: int,
        entropy_coef: float,
    ) -> MetricSums:
        t, dp = self.cfg.trainer, self.info.dp_size
        mini = t.policy_mini_batch_size * self.cfg.generator.n_samples_per_prompt // dp
        losses: list[float] = []
        grad_norms: list[float] = []
        # (clipped tokens, loss tokens) per microbatch: the step's clip fraction is a
        # token mean, so one rank and two ranks report the same fraction (a mean of
        # microbatch fractions over-weights short microbatches).
        clip_counts: list[tuple[float, float]] = []
        # The off-policy correction's sums over microbatches, each metric over its own
        # denominator. First epoch only: its weights depend on the old and rollout
        # logprobs alone, so later epochs would repeat the same counts.
        off_policy = MetricSums()
        # R2: (agreeing token-layers, token-layers) of every update forward with the
        # recorded routes, the proof that each mini-batch and epoch replayed them.
        r2_counts: list[tuple[float, float]] = []
        lr: float | None = None
        skipped = 0
        # Each mini-batch's plan, made (and its count agreed) in the first epoch and kept
        # for the later ones, which train the same rows.
        plans: dict[int, MicrobatchPlan] = {}
        for epoch in range(t.update_epochs_per_batch):
            for k, start in enumerate(range(0, batch.batch_size, mini)):
                part = slice_batch(batch, start, min(start + mini, batch.batch_size))
                global_tokens = (
                    float(training_loss_mask(part).sum())
                    if mini_batch_tokens is None
                    else mini_batch_tokens[k]
                )
                if global_tokens == 0:
                    # Nothing to learn from (flat groups left out by skip_flat_steps or
                    # zero_variance_filter): no optimizer step, since Adam's momentum
                    # alone would go on moving the weights. Every rank sees the same
                    # global count and skips.
                    skipped += 1
                    continue
                # The same count on every rank (the plan agrees it), so each divides
                # by the same share of the token mean over the global mini-batch
                # (algorithms/token_mean.py); the worker does the rest.
                if k not in plans:
                    plans[k] = self._microbatches(part, t.micro_train_batch_size_per_gpu)
                micro = plans[k]
                tokens = microbatch_denominator(global_tokens, microbatches=micro.count, dp_size=dp)

                loss_fn = policy_loss_fn(
                    t.algorithm,
                    tokens=tokens,
                    clip_counts=clip_counts,
                    off_policy=off_policy if epoch == 0 else None,
                    entropy_coef=entropy_coef,
                )
                result = self.worker.train_step(
                    part,
                    loss_fn=loss_fn,
                    micro_batch_size=micro,
                    replay_routes=plan.update.replay,
                    entropy=t.algorithm.use_entropy_loss,
                    capture_routes=plan.update.capture,
                    trajectory_ids=trajectory_ids(part),
                )
                if plan.update.capture:
                    assert result.routes is not None
                    got = self.worker.rollout_router_agreement(part, result.routes)
                    r2_counts.append(
                        (got.agreement * got.num_token_layers, float(got.num_token_layers))
                    )
                where = f"rank {self.info.rank}, optimizer step {len(grad_norms) + 1}"
                require_finite(result.loss, quantity="train/policy_loss", step=step, where=where)
                require_finite(result.grad_norm, quantity="train/grad_norm", step=step, where=where)
                # The worker returns the mean of its microbatch losses, each a token sum
                # over ``microbatch_denominator`` (the global count over microbatches *
                # dp): that mean is this shard's share of the mini-batch token mean
                # times dp (the whole mean on one rank; algorithms/token_mean.py).
                losses.append(result.loss)
                grad_norms.append(result.grad_norm)
                lr = result.lr
        metrics = MetricSums()
        # Per rank, the mean over its optimizer steps. Every rank takes the same steps
        # and reports the same all-reduced grad norm; its loss is its share of each
        # mini-batch's token mean scaled by dp (see above), so summed over ranks and
        # divided by every rank's step count it is the mini-batch token mean.
        metrics.mean("train/policy_loss", sum(losses), len(losses))
        metrics.mean("train/grad_norm", sum(grad_norms), len(grad_norms))
        metrics.mean(
            "policy/clip_fraction", sum(c for c, _ in clip_counts), sum(n for _, n in clip_counts)
        )
        # One value per rank, equal on every rank: a mean over ranks keeps it.
        metrics.mean("train/optimizer_steps", float(len(grad_norms)), 1.0)
        metrics.mean("train/skipped_optimizer_steps", float(skipped), 1.0)
        # No step taken (a skipped flat step): the rate the next step would use, which
        # during warm-up is not the configured peak.
        metrics.mean("train/lr", lr if lr is not None else self.worker.scheduled_lr(), 1.0)
        if len(off_policy):
            metrics.merge(off_policy)
            if OffPolicyCorrection.from_algorithm_config(t.algorithm).tis_ratio_type:
                # Kept for the readers of the old name: off_policy/weight_mean, the mean
                # TIS weight of the tokens left in the loss, over the same denominator.
                metrics.mean("train/tis_weight_mean", *off_policy.parts("off_policy/weight_mean"))
        if r2_counts:
            layers = sum(n for _, n in r2_counts)
            metrics.mean(
                "r2/router_agreement_update", sum(a for a, _ in r2_counts), layers, empty=1.0
            )
            metrics.total("r2/num_token_layers", layers)
        return metrics

    def score(self, batch: TrainingBatch) -> torch.Tensor | None:
        """The current weights' logprobs ``[B, R]`` of ``batch``'s response tokens (the
        served-weights check, ``served_weights.py``): with the batch's routes replayed
        when it carries the engine's, else with the trainer's own routing, and no
        token dropped at an expert capacity, as the engines compute. Every rank runs
        it (experts and stages meet in collectives); only the last pipeline stage
        holds logprobs, the others return None."""
        logprobs = self.worker.forward(
            batch,
            micro_batch_size=self._microbatches(
                batch, self.cfg.trainer.micro_forward_batch_size_per_gpu
            ),
            replay_routes=batch.routed_experts is not None,
            # The probe is greedy and the engine reports it under the raw logits.
            temperature=1.0,
            # An expert capacity is a training-time choice no engine makes: scored with
            # it, right weights read 1.04 off at factor 1.0 (issue 49).
            drop_tokens=False,
            trajectory_ids=trajectory_ids(batch),
        ).logprobs
        return logprobs if self.info.is_last_stage else None

    def _native_forward(
        self,
        batch: TrainingBatch,
        plan: ReplayPlan,
        as_trained: ForwardResult,
        micro: int | MicrobatchPlan,
    ) -> ForwardResult:
        """The trainer's own routing of ``batch``: the as-trained forward when it did not
        replay, else one more forward without replay (``plan.native_forward``)."""
        if not plan.native_forward:
            return as_trained
        return self.worker.forward(
            batch,
            micro_batch_size=micro,
            replay_routes=False,
            capture_routes=True,
            trajectory_ids=trajectory_ids(batch),
        )

    def inspect(self, batch: TrainingBatch) -> Inspection | None:
        """What the rollout dumps show of ``batch`` (a few rows, before the update): the
        logprobs the old-logprob pass computes (replayed as the step trains) and, when
        the batch carries the engine's routes, where the trained and the trainer's own
        routing chose other experts than the engine (``[B, S, L]``). Every rank runs it;
        the last pipeline stage returns it, the others None."""
        plan = ReplayPlan.decide(
            self.cfg.trainer.policy.routing_replay, rollout_routes=batch.routed_experts is not None
        )
        micro = self._microbatches(batch, self.cfg.trainer.micro_forward_batch_size_per_gpu)
        names = trajectory_ids(batch)
        trained = self.worker.forward(
            batch,
            micro_batch_size=micro,
            replay_routes=plan.old_logprobs.replay,
            capture_routes=plan.rollout_routes,
            trajectory_ids=names,
        )
        flips = native_flips = None
        if plan.rollout_routes:
            native = self._native_forward(batch, plan, trained, micro)
            assert trained.routes is not None and native.routes is not None
            flips = self.worker.rollout_router_flips(batch, trained.routes)
            native_flips = self.worker.rollout_router_flips(batch, native.routes)
        if not self.info.is_last_stage:
            return None
        return Inspection(trained.logprobs.cpu(), flips, native_flips)

    # ---- weights and checkpoints ----------------------------------------------------

    def export_hf(
        self, folder: str, source: str, *, write: bool, max_shard_bytes: int
    ) -> WeightFiles | None:
        """This rank's part of a Hugging Face export (``PolicyGroup.export_hf``): the
        writer streams the whole model into ``folder`` (``runs/export.py``); a rank whose
        experts or layers are sharded joins the stream's collectives in lockstep, as in
        ``push_weights`` for a rank without URLs."""
        if write:
            return write_weights(
                Path(folder),
                self.worker.export_weights(),
                source=Path(source),
                max_shard_bytes=max_shard_bytes,
            )
        self._join_export()
        return None

    def _join_export(self) -> None:
        """A rank that neither pushes nor writes still runs the export when weights are
        sharded over ranks (experts, stages, tensors, FSDP shards): the stream gathers
        them, and every rank must take part in lockstep (``RankInfo.collective_export``;
        a 2-rank FSDP launch hung in the first push without it)."""
        if self.info.collective_export:
            for _ in self.worker.export_weights():
                pass

    def push_weights(
        self, urls: list[str], *, api_key: str | None = None, policy_version: int | None = None
    ) -> dict[str, float]:
        """Send the weights to ``urls``; with ``policy_version`` each server loads the
        whole push in one step as that version (``WeightSyncer.push``). A rank given no
        URLs still runs the export when experts or layers are sharded: the export
        gathers experts over the EP group and stages over the pipeline group, in
        lockstep."""
        from skyrl_train.trainer.engine_clients import ClientOptions, make_client

        if not urls:
            self._join_export()
            return {}

        async def push() -> dict[str, float]:
            # Push-only clients: no EOS ids or route shape (they never generate).
            options = ClientOptions(
                backend=self.cfg.generator.inference_engine.backend,
                api_key=api_key,
                family=self.worker.architecture.family,
                weight_url_host=self.cfg.generator.inference_engine.vllm.weight_url_host,
            )
            clients = [make_client(url, options) for url in urls]
            try:
                stats = await self.syncer.push(
                    clients, self.worker.export_weights(), policy_version=policy_version
                )
            finally:
                await asyncio.gather(*(c.close() for c in clients))
            return {
                "sync/tensors_sent": float(stats.tensors_sent),
                "sync/tensors_total": float(stats.tensors_total),
                "sync/mbytes_sent": stats.bytes_sent / 2**20,
            }

        return asyncio.run(push())

    def save_checkpoint(self, folder: str) -> None:
        """Each rank writes its own shard (its experts, optimizer state and RNGs) into
        the driver's temp folder (``checkpoint.begin_save``), fsynced before returning:
        the driver's manifest then vouches for bytes already on disk. Plain data only
        (``runs.rank_file``), so a resume never runs pickled code."""
        state = rank_checkpoint(self.worker, world_size=self.info.world_size, layout=self._layout())
        save_rank_state(checkpoint_file(Path(folder), self.info.rank), state)

    def _layout(self) -> dict[str, int | None]:
        """The layout record of this rank's files: the layout its worker reported at
        setup (``RankInfo.layout``), never read from a backend's config."""
        return self._reported_layout().record()

    def _reported_layout(self) -> ParallelLayout:
        if self.info.layout is None:
            raise RuntimeError("info.layout: expected the worker's layout (setup first), got None")
        return self.info.layout

    def load_checkpoint(self, folder: str) -> None:
        """Restore this rank from ``folder``, which the launch verified against its
        manifest (``resume.verify_resume``) before Ray started; rank files are read
        with ``torch.load(weights_only=True)``. A checkpoint of another layout (world
        size, TP, PP, VPP, EP or ETP) is resharded (``runs/resume.py``)."""
        resharded = restore_rank(
            Path(folder),
            self.worker,
            rank=self.info.rank,
            world_size=self.info.world_size,
            layout=self._layout(),
            strategy=self._reported_layout().backend,
        )
        if resharded is not None:
            logger.info(
                "rank %d: resharded %s (%d parameters, %d with AdamW state; RNG of old rank %s)",
                self.info.rank,
                folder,
                resharded.parameters,
                resharded.moments,
                resharded.rng_from,
            )
