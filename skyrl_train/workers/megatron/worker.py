"""The Megatron-core policy worker: forward log-probs, train steps, weight export, R3.

Every forward and every train step runs through Megatron's own schedules
(``get_forward_backward_func``: no pipelining, 1F1B, or interleaved with virtual
stages), on CPU too (``cpu_compat``). The optimizer and its schedule are the backends'
shared ones (``algorithms/optim.py``: plain AdamW, as Megatron's optimizer wrapper
hard-codes CUDA). Data-parallel gradients are averaged by hand over
Megatron's groups, the way its DDP scales them (dense and expert grads both by
1/dp_size).

Expert parallelism with the allgather dispatcher gathers every EP rank's tokens, so
all ranks of an EP group must run the same number of microbatches of the same shape.
With pipeline parallelism every microbatch of a schedule is padded to one shape (stages
exchange fixed-shape activations), the losses and log-probs exist on the last stage
and are broadcast to the others, and routes captured on each stage are gathered so
every rank sees all MoE layers.

Kept whole: one rank's model and the state it owns (chunks, routers, optimizer, pipeline
group) with the calls the trainer makes on it; the schedule, gradient reduction, replay
driver, weight conversion and batch layout are their own modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from inference.models.architecture import MoEArchitecture
from skyrl_train.algorithms import optim
from skyrl_train.algorithms.mismatch import RouterAgreement
from skyrl_train.config.constraints import check_constraints
from skyrl_train.config.routing_replay import refuse_conflicting_alias
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.errors import ConfigValidationError
from skyrl_train.workers import routes as route_checks
from skyrl_train.workers import step
from skyrl_train.workers.base import (
    EntropyLossFn,
    ForwardResult,
    LossFn,
    RankInfo,
    TrainStepResult,
    check_swapped_weights,
)
from skyrl_train.workers.batch_layout import as_plan, score_responses, split_microbatches
from skyrl_train.workers.megatron import capacity, convert, replay
from skyrl_train.workers.megatron.cpu_compat import apply_cpu_compat
from skyrl_train.workers.megatron.gradients import (
    average_data_parallel_grads,
    clip_grad_norm,
    sum_sequence_parallel_grads,
)
from skyrl_train.workers.megatron.groups import init_parallel_state
from skyrl_train.workers.megatron.layout import VocabShard
from skyrl_train.workers.megatron.model import (
    MEGATRON_CONFIG_KEY,
    build_model_chunks,
    build_transformer_config,
    padded_vocab_size,
)
from skyrl_train.workers.megatron.pipeline import PipelineGroup
from skyrl_train.workers.megatron.schedule import (
    Head,
    Microbatches,
    ReplayDriverFactory,
    gather_routes,
    run_schedule,
)
from skyrl_train.workers.microbatches import MicrobatchPlan


class MegatronPolicyWorker:
    """One rank's policy model, the Megatron backend's ``workers.base.PolicyWorker``
    (its gradient and route contracts). Build with the checkpoint's architecture and
    the ``trainer.policy.megatron_config`` node, then ``setup()``. Routes are
    ``[B, S, L_moe, K]``: MoE layers only, every stage's."""

    replay_driver: ReplayDriverFactory = replay.KeyedReplay
    """Builds the schedule's replay driver from the routers and each microbatch's
    routes; its ``arm(chunk, microbatch)`` runs before a chunk's forward and
    ``on_backward(chunk, microbatch)`` when the gradient reaches that chunk's output."""

    def __init__(
        self,
        architecture: MoEArchitecture,
        megatron_config: MegatronConfig,
        *,
        optimizer: OptimizerConfig | None = None,
        seed: int = 0,
        pad_token_id: int = 0,
        temperature: float = 1.0,
        routing_replay: bool = True,
        remove_microbatch_padding: bool = False,
    ) -> None:
        # A node built in Python skipped Hydra and validate_cfg: refuse a bad one here.
        check_constraints(megatron_config, prefix=MEGATRON_CONFIG_KEY)
        refuse_conflicting_alias(megatron_config, routing_replay=routing_replay)
        self.architecture = architecture
        self.megatron_config = megatron_config
        self.optimizer_config = optimizer if optimizer is not None else OptimizerConfig()
        """``trainer.policy.optimizer_config``; a ``max_grad_norm`` <= 0 (tests only: the
        schema wants > 0) disables clipping."""
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        """The rollout sampler's temperature: every forward scores tokens under
        softmax(logits / temperature), over the batch's ``sample_support`` when it has one."""
        self.remove_microbatch_padding = remove_microbatch_padding
        """``trainer.remove_microbatch_padding``: each microbatch's rows run packed into
        one (``workers/packed_layout.py``), no padding reaching the model."""
        self.routing_replay = routing_replay
        """``trainer.policy.routing_replay.enabled``: the model is built to replay (and
        replays by default when a batch carries routes)."""
        self.model: Any = None
        """This rank's model: its one chunk, or a ModuleList of its virtual stages'."""
        self.chunks: list[Any] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.routers: replay.LocalRouters | None = None
        self._pipeline = PipelineGroup(size=1, rank=0, virtual_stages=None)

    # ---- setup -----------------------------------------------------------------

    def setup(self) -> MegatronPolicyWorker:
        """Resolve the Megatron config (refusing what defeats replay), initialise
        parallel state, build the model and the optimizer."""
        apply_cpu_compat()
        config = build_transformer_config(
            self.architecture, self.megatron_config, routing_replay=self.routing_replay
        )
        init_parallel_state(self.megatron_config, seed=self.seed)
        rows = padded_vocab_size(self.architecture.vocab_size, self.megatron_config)
        self.chunks = build_model_chunks(
            self.architecture,
            config,
            seed=self.seed,
            vocab_rows=rows,
            packed=self.remove_microbatch_padding,
        )
        self.model = self.chunks[0] if len(self.chunks) == 1 else torch.nn.ModuleList(self.chunks)
        self._pipeline = PipelineGroup.current()
        self.routers = replay.local_routers(self.chunks)
        if self.routers.moe_layers != self.architecture.moe_layers:
            # The engine's routes cover the checkpoint's MoE layers; a passthrough
            # moe_layer_freq that builds others would replay them into the wrong layers.
            raise ConfigValidationError(
                f"{MEGATRON_CONFIG_KEY}.transformer_config_kwargs.moe_layer_freq",
                expected=f"MoE layers {list(self.architecture.moe_layers)} (the checkpoint's)",
                got=str(list(self.routers.moe_layers)),
            )
        self.optimizer = optim.build_optimizer(self.model.parameters(), self.optimizer_config)
        return self

    # ---- weights ----------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors of the architecture's family (the engine's layout);
        returns how many."""
        return convert.load_hf_weights(self._require_chunks(), named_tensors, self.architecture)

    def parameter_snapshot(self) -> dict[str, torch.Tensor]:
        """A detached copy of this rank's parameters (its shards), for ``swapped_weights``."""
        return {name: p.detach().clone() for name, p in self._require_model().named_parameters()}

    @contextmanager
    def swapped_weights(self, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Run the model on ``weights`` (a ``parameter_snapshot``) instead of its own.

        Each parameter's storage is swapped, not copied, and swapped back on exit, an
        exception included; the routers, layout and replay state stay the model's, so a
        forward in here replays routes exactly as the policy's does.
        """
        params = dict(self._require_model().named_parameters())
        check_swapped_weights(params, weights)
        own: dict[str, torch.Tensor] = {}
        try:
            for name, param in params.items():
                own[name] = param.data
                param.data = weights[name]
            yield
        finally:
            for name, data in own.items():
                params[name].data = data

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the whole model's weights in the engine's layout, one tensor at a time.
        With EP > 1 or PP > 1 every rank of those groups must consume it in lockstep."""
        return convert.export_hf_weights(self._require_chunks(), self.architecture)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters (its shards), as its model names them."""
        return self._require_model().named_parameters()

    # ---- checkpoints (runs/rank_contract.py's Checkpointable) ------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """The model's and AdamW's state dicts, and where each parameter sits in the
        whole model (``placement.placement_record``), for another layout's resume."""
        from skyrl_train.runs.rank_contract import PLACEMENT_KEY
        from skyrl_train.workers.megatron.placement import placement_record

        assert self.optimizer is not None
        return {
            "model": self._require_model().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            PLACEMENT_KEY: placement_record(self._require_chunks()),
        }

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Load a ``checkpoint_state`` of this layout (or one resharded to it), every
        entry checked first (``placement.check_state``: ``StateMismatch``)."""
        from skyrl_train.workers.megatron.placement import check_state

        assert self.optimizer is not None
        check_state(self._require_model(), self.optimizer, state)
        self._require_model().load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def rank_info(self) -> RankInfo:
        """This rank's place in torch.distributed and Megatron's parallel groups."""
        from megatron.core import parallel_state

        from skyrl_train.workers.megatron.placement import parallel_layout

        self._require_model()
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        world_size = torch.distributed.get_world_size()
        return RankInfo(
            rank=torch.distributed.get_rank(),
            world_size=world_size,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
            ep_size=ep_size,
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            pp_size=pp_size,
            tp_size=tp_size,
            # Data-parallel ranks hold whole copies: only these layouts split weights.
            collective_export=ep_size > 1 or pp_size > 1 or tp_size > 1,
            layout=parallel_layout(self.megatron_config, world=world_size),
        )

    # ---- forward ----------------------------------------------------------------

    def forward(
        self,
        batch: TrainingBatch,
        *,
        micro_batch_size: int | MicrobatchPlan | None = None,
        replay_routes: bool | None = None,
        capture_routes: bool = False,
        trajectory_ids: Sequence[str] | None = None,
        entropy: bool = False,
        temperature: float | None = None,
        drop_tokens: bool = True,
    ) -> ForwardResult:
        """Response logprobs ``[B, R]`` without gradient, microbatch by microbatch.

        ``replay_routes=None`` replays when the config enables it and the batch has routes.
        ``entropy=True`` also returns each response position's entropy.
        ``temperature``: None scores under the rollout sampler's (``self.temperature``);
        1.0 with a batch without ``sample_support`` gives the raw logits' logprobs.
        ``drop_tokens=False``: no expert capacity for this forward (``capacity.py``).
        """
        temperature = self.temperature if temperature is None else temperature
        do_replay = self._check_replay(batch, replay_routes, trajectory_ids)
        batches = self._prepare(batch, micro_batch_size)
        logprobs: list[torch.Tensor | None] = [None] * batches.count
        entropies: list[torch.Tensor | None] = [None] * batches.count

        vocab = self.architecture.vocab_size

        def keep(m: int, logits: torch.Tensor) -> torch.Tensor:
            lp, ent = _response(
                logits, batches, m, entropy=entropy, temperature=temperature, vocab_size=vocab
            )
            logprobs[m] = lp.cpu()
            entropies[m] = ent.cpu() if ent is not None else None
            return torch.zeros(())

        self._require_model().eval()
        with torch.no_grad(), capacity.token_dropping(self.chunks, enabled=drop_tokens):
            routes = self._run(
                batches, head=keep, forward_only=True, replay=do_replay, capture=capture_routes
            )
        # Under pipelining only the last stage computed these.
        shapes = [(mb.batch_size, mb.response_mask.shape[1]) for mb in batches.micro]
        got = self._pipeline.tensors_from_last_stage(logprobs, shapes)
        ents = self._pipeline.tensors_from_last_stage(entropies, shapes) if entropy else None
        return ForwardResult(
            logprobs=batches.in_batch_order(got),
            routes=routes,
            entropy=batches.in_batch_order(ents) if ents is not None else None,
        )

    def rollout_router_agreement(
        self, batch: TrainingBatch, routes: torch.Tensor
    ) -> RouterAgreement:
        """Agreement of ``routes`` (``ForwardResult.routes``: every MoE layer) with the
        batch's rollout routes (``workers/routes.py``)."""
        return route_checks.rollout_agreement(batch, routes, self._require_routers())

    def rollout_router_flips(self, batch: TrainingBatch, routes: torch.Tensor) -> torch.Tensor:
        return route_checks.rollout_differences(batch, routes, self._require_routers())

    # ---- training -----------------------------------------------------------------

    def train_step(
        self,
        batch: TrainingBatch,
        *,
        loss_fn: LossFn | EntropyLossFn,
        micro_batch_size: int | MicrobatchPlan,
        replay_routes: bool | None = None,
        trajectory_ids: Sequence[str] | None = None,
        entropy: bool = False,
        capture_routes: bool = False,
    ) -> TrainStepResult:
        """One optimizer step over ``batch`` (this rank's shard), accumulating gradients
        over microbatches. ``loss_fn(logprobs [b, R], microbatch) -> scalar``; with
        ``entropy=True`` it also gets the differentiable per-token entropy ``[b, R]``
        (``EntropyLossFn``), for an entropy bonus. ``capture_routes``: also return what
        the routers dispatched in the forwards (not in any backward recompute)."""
        model, optimizer = self._require_model(), self.optimizer
        assert optimizer is not None
        do_replay = self._check_replay(batch, replay_routes, trajectory_ids)
        batches = self._prepare(batch, micro_batch_size)
        losses = step.MicrobatchLosses(loss_fn, batches.count)

        vocab = self.architecture.vocab_size

        def loss(m: int, logits: torch.Tensor) -> torch.Tensor:
            lp, ent = _response(
                logits, batches, m, entropy=entropy, temperature=self.temperature, vocab_size=vocab
            )
            return losses(m, lp, ent, batches.micro[m])

        step.begin_step(model, optimizer)
        routes = self._run(
            batches, head=loss, forward_only=False, replay=do_replay, capture=capture_routes
        )
        params = list(model.parameters())
        sum_sequence_parallel_grads(model)
        average_data_parallel_grads(params)
        grad_norm = clip_grad_norm(
            params, max_norm=self.optimizer_config.max_grad_norm, pipeline=self._pipeline
        )
        return step.finish_step(
            optimizer,
            self.optimizer_config,
            grad_norm=grad_norm,
            # A broadcast over the pipeline group, which every stage runs here alike.
            losses=self._pipeline.from_last_stage(losses.values),
            replayed=do_replay,
            routes=routes,
        )

    # ---- the schedule -----------------------------------------------------------------

    def _prepare(self, batch: TrainingBatch, size: int | MicrobatchPlan | None) -> Microbatches:
        """The schedule's microbatches: ``size`` rows each, or a plan's row groups (results
        come back in batch order); packed with ``remove_microbatch_padding``."""
        plan = as_plan(batch, size)
        return Microbatches.prepare(
            split_microbatches(batch, plan),
            self._pipeline,
            pad_token_id=self.pad_token_id,
            sequence_shards=self._require_routers().sequence_shards,
            plan=plan,
            packed=self.remove_microbatch_padding,
            exchange_group=self._token_exchange_group() if self.remove_microbatch_padding else None,
        )

    def _token_exchange_group(self) -> Any:
        """The ranks whose MoE dispatcher exchanges tokens while holding other rows
        (expert parallelism's), or None: packed rows are then made one length there."""
        from megatron.core import parallel_state

        if parallel_state.get_expert_model_parallel_world_size() == 1:
            return None
        return parallel_state.get_expert_tensor_and_model_parallel_group()

    def _run(
        self, batches: Microbatches, *, head: Head, forward_only: bool, replay: bool, capture: bool
    ) -> torch.Tensor | None:
        """``run_schedule`` on this rank's chunks; the captured routes as
        ``[B, S, L_moe, K]`` in the batch layout when ``capture``."""
        routers = self._require_routers()
        got = run_schedule(
            self._require_chunks(),
            routers,
            batches,
            head=head,
            forward_only=forward_only,
            replay_driver=self.replay_driver if replay else None,
            capture=capture,
        )
        return gather_routes(routers, self._pipeline, batches, got) if got is not None else None

    def scheduled_lr(self) -> float:
        """The learning rate the next optimizer step uses (warm-up included): what a
        step that skipped every update reports as ``train/lr``."""
        assert self.optimizer is not None
        return optim.scheduled_lr(self.optimizer_config, self.optimizer)

    def _require_model(self) -> Any:
        if self.model is None:
            raise RuntimeError("MegatronPolicyWorker: call setup() first")
        return self.model

    def _require_chunks(self) -> list[Any]:
        self._require_model()
        return self.chunks

    def _require_routers(self) -> replay.LocalRouters:
        self._require_model()
        assert self.routers is not None
        return self.routers

    def _check_replay(
        self,
        batch: TrainingBatch,
        replay_routes: bool | None,
        trajectory_ids: Sequence[str] | None,
    ) -> bool:
        return step.check_replay(
            batch,
            replay_routes,
            self._require_routers(),
            routing_replay=self.routing_replay,
            trajectory_ids=trajectory_ids,
        )


def _response(
    logits: torch.Tensor,
    batches: Microbatches,
    m: int,
    *,
    entropy: bool,
    temperature: float,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Microbatch ``m``'s response logprobs ``[b, R]`` and, with ``entropy``, entropy,
    under the rollout sampler's distribution, on this rank's vocabulary shard (ids from
    ``vocab_size`` on are the padding of ``padded_vocab_size`` and never count)."""
    return score_responses(
        logits,
        batches.layouts[m],
        batches.micro[m],
        entropy=entropy,
        temperature=temperature,
        shard=VocabShard.of(logits.shape[-1], real_vocab=vocab_size),
    )
