"""The FSDP2 policy worker: transformers' own model class, ``fully_shard`` per decoder
layer over the data-parallel ranks, routing replay by hooks on each MoE layer's gate.

The same contracts as the Megatron worker (``workers/base.py``): consecutive
microbatches, each loss times 1/microbatches, gradients averaged over the ranks
(FSDP2's reduce-scatter averages: sum over DP / dp_size), the global norm before
clipping, AdamW and its warm-up from ``algorithms/optim.py``, the batch re-laid out
contiguous from position 0 and scored under the rollout sampler
(``workers/batch_layout.py``, ``algorithms/sampler_replay.py``). Every forward is a
collective under FSDP (each layer all-gathers its weights), so every rank runs the same
number of microbatches: the trainer gives every data-parallel rank the same row count.

Nothing here imports megatron: an FSDP user may not have megatron-core working.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from inference.models.architecture import MoEArchitecture
from skyrl_train.algorithms import optim
from skyrl_train.algorithms.mismatch import RouterAgreement
from skyrl_train.config.constraints import check_constraints
from skyrl_train.config.schema import FSDPConfig, OptimizerConfig
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.workers import routes as route_checks
from skyrl_train.workers import step
from skyrl_train.workers.base import (
    EntropyLossFn,
    ForwardResult,
    LossFn,
    RankInfo,
    TrainStepResult,
)
from skyrl_train.workers.batch_layout import (
    ContiguousBatch,
    as_plan,
    make_contiguous,
    score_responses,
    split_microbatches,
)
from skyrl_train.workers.fsdp import packed as packed_attention
from skyrl_train.workers.fsdp import state
from skyrl_train.workers.fsdp.model import (
    FSDP_CONFIG_KEY,
    build_hf_model,
    device_type,
    shard_model,
)
from skyrl_train.workers.microbatches import MicrobatchPlan
from skyrl_train.workers.packed_layout import PackedBatch, pack_rows


class FSDPPolicyWorker:
    """One rank's policy model, the FSDP backend's ``workers.base.PolicyWorker``. Build
    with the checkpoint folder, its architecture and the ``trainer.policy.fsdp_config``
    node, then ``setup()``. Routes are ``[B, S, L_moe, K]``."""

    def __init__(
        self,
        checkpoint: str | Path,
        architecture: MoEArchitecture,
        fsdp_config: FSDPConfig,
        *,
        optimizer: OptimizerConfig | None = None,
        seed: int = 0,
        pad_token_id: int = 0,
        temperature: float = 1.0,
        routing_replay: bool = True,
        remove_microbatch_padding: bool = False,
    ) -> None:
        # A node built in Python skipped Hydra and validate_cfg: refuse a bad one here.
        check_constraints(fsdp_config, prefix=FSDP_CONFIG_KEY)
        self.checkpoint = Path(checkpoint)
        self.architecture = architecture
        self.fsdp_config = fsdp_config
        self.optimizer_config = optimizer if optimizer is not None else OptimizerConfig()
        """``trainer.policy.optimizer_config``; a ``max_grad_norm`` <= 0 (tests only: the
        schema wants > 0) disables clipping."""
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        """The rollout sampler's temperature (as the Megatron worker's)."""
        self.remove_microbatch_padding = remove_microbatch_padding
        """``trainer.remove_microbatch_padding``: each microbatch's rows run packed into
        one (``workers/packed_layout.py``), no padding reaching the model."""
        self.routing_replay = routing_replay
        """``trainer.policy.routing_replay.enabled``: replay is allowed (and the default
        when a batch carries routes)."""
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.gates: Any = None
        self.device = torch.device("cpu")
        self.mesh: Any = None
        """The 1-D device mesh of every rank the model is sharded over."""
        self.model_class = ""

    # ---- setup -----------------------------------------------------------------

    def setup(self) -> FSDPPolicyWorker:
        """Build the model from the checkpoint's config, shard it over the process
        group's ranks (a world of one when this process has none), hook the gates and
        build the optimizer."""
        from skyrl_train.workers.fsdp.replay import GateReplay

        attention = self.fsdp_config.attn_implementation
        if self.remove_microbatch_padding:  # the padded path keeps its kernel
            attention = packed_attention.attention_implementation(
                attention, device_type=device_type(), param_dtype=self.fsdp_config.param_dtype
            )
        model = build_hf_model(self.checkpoint, seed=self.seed, attn_implementation=attention)
        if device_type() == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        model.to(self.device)
        # fully_shard swaps the class for an FSDP subclass; messages name the model's own.
        self.model_class = type(model).__name__
        self.mesh = shard_model(model, self.fsdp_config)
        # Refuses a model whose layers or gates are not the architecture's.
        self.gates = GateReplay(model, self.architecture)
        self.model = model
        self.optimizer = optim.build_optimizer(model.parameters(), self.optimizer_config)
        return self

    # ---- weights ----------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors (the model's own parameter names, the engine's layout),
        each checked by name and shape before it is copied; returns how many."""
        params = dict(self._require_model().named_parameters())
        count = 0
        for name, tensor in named_tensors:
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"{name}: expected a {self.model_class} weight (one of its "
                    f"{len(params)} parameters, e.g. {next(iter(params))!r}), got an unknown name"
                )
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}.shape: expected {tuple(param.shape)}, got {tuple(tensor.shape)}"
                )
            state.copy_full_(param, tensor)
            count += 1
        return count

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters (its shards, DTensors), as the model names them."""
        return self._require_model().named_parameters()

    def parameter_snapshot(self) -> dict[str, torch.Tensor]:
        """A detached copy of this rank's parameters (its shards), for ``swapped_weights``."""
        return {name: p.detach().clone() for name, p in self._require_model().named_parameters()}

    @contextmanager
    def swapped_weights(self, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Run the model on ``weights`` (a ``parameter_snapshot``) inside the block.

        Copied into the shards and back rather than swapping storage: FSDP2 all-gathers
        from its own flat shard buffer, which a swapped ``.data`` would not reach. The
        model's own weights are back on exit, an exception included."""
        with state.copied_in(dict(self._require_model().named_parameters()), weights):
            yield

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model's weights in the engine's HF layout, one full CPU tensor at a
        time; each is an all-gather, so every rank consumes it in lockstep."""
        for name, param in self._require_model().named_parameters():
            yield name, state.full_tensor(param)

    # ---- checkpoints (runs/rank_contract.py's Checkpointable) ------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's shards of the model and AdamW as plain data, with their
        placement records and the backend's name (``fsdp/checkpoint.py``)."""
        from skyrl_train.workers.fsdp import checkpoint

        assert self.optimizer is not None
        return checkpoint.checkpoint_state(self._require_model(), self.optimizer)

    def load_checkpoint_state(self, saved: Mapping[str, Any]) -> None:
        """Load a ``checkpoint_state`` of this layout, or one ``runs/reshard.py`` cut
        for it from another number of ranks (``fsdp/checkpoint.py``)."""
        from skyrl_train.workers.fsdp import checkpoint

        assert self.optimizer is not None
        checkpoint.load_checkpoint_state(self._require_model(), self.optimizer, saved)

    def rank_info(self) -> RankInfo:
        """Every rank is a data-parallel rank (one shard group over the world)."""
        self._require_model()
        from skyrl_train.workers.fsdp.checkpoint import parallel_layout

        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        # Every weight is sharded over every rank: each one's export is an all-gather.
        return RankInfo(
            rank,
            world,
            rank,
            world,
            ep_size=1,
            collective_export=world > 1,
            layout=parallel_layout(world),
        )

    def scheduled_lr(self) -> float:
        """The learning rate the next optimizer step uses (warm-up included)."""
        assert self.optimizer is not None
        return optim.scheduled_lr(self.optimizer_config, self.optimizer)

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
        """Response logprobs ``[B, R]`` without gradient, microbatch by microbatch
        (``workers.base.PolicyWorker.forward``), in the batch's row order whatever
        order a ``MicrobatchPlan`` runs the rows in. ``drop_tokens`` changes nothing:
        the Hugging Face MoE blocks have no expert capacity."""
        temperature = self.temperature if temperature is None else temperature
        do_replay = self._check_replay(batch, replay_routes, trajectory_ids)
        micro = self._microbatches(batch, micro_batch_size)
        logprobs, entropies, routes = [], [], []
        model = self._require_model()
        model.eval()
        try:
            with torch.no_grad():
                for mb in micro:
                    layout = self._layout(mb)
                    with self.gates.session(
                        routes=layout.routes if do_replay else None, capture=capture_routes
                    ) as recorder:
                        lp, ent = score_responses(
                            self._logits(layout),
                            layout,
                            mb,
                            entropy=entropy,
                            temperature=temperature,
                        )
                    logprobs.append(lp.cpu())
                    if ent is not None:
                        entropies.append(ent.cpu())
                    if capture_routes:
                        routes.append(layout.to_batch_layout(recorder.routes()))
        finally:
            # Without a backward nothing reshards a layer kept gathered after its
            # forward (reshard_after_forward=False), and while gathered FSDP2 registers
            # the whole tensors as its parameters: a weight load would write those and
            # be dropped at the next reshard (test_fsdp_worker.py, gathered layers).
            state.reshard(model)
        plan = as_plan(batch, micro_batch_size)
        return ForwardResult(
            logprobs=plan.in_batch_order(logprobs),
            routes=plan.in_batch_order(routes) if capture_routes else None,
            entropy=plan.in_batch_order(entropies) if entropy else None,
        )

    def rollout_router_agreement(
        self, batch: TrainingBatch, routes: torch.Tensor
    ) -> RouterAgreement:
        """Agreement of ``routes`` with the batch's rollout routes (``workers/routes.py``)."""
        return route_checks.rollout_agreement(batch, routes, self._require_gates())

    def rollout_router_flips(self, batch: TrainingBatch, routes: torch.Tensor) -> torch.Tensor:
        return route_checks.rollout_differences(batch, routes, self._require_gates())

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
        """One optimizer step over ``batch`` (this rank's shard): the gradient contract
        of ``workers/base.py``. Each microbatch's backward runs inside its replay
        session, so a recomputed layer (activation checkpointing) replays the same ids."""
        model, optimizer = self._require_model(), self.optimizer
        assert optimizer is not None
        do_replay = self._check_replay(batch, replay_routes, trajectory_ids)
        micro = self._microbatches(batch, micro_batch_size)
        losses, plan = step.MicrobatchLosses(loss_fn, len(micro)), as_plan(batch, micro_batch_size)
        routes: list[torch.Tensor] = []
        step.begin_step(model, optimizer)
        try:
            self._accumulate(
                micro, losses, routes, replay=do_replay, entropy=entropy, capture=capture_routes
            )
        finally:
            state.reshard(model)  # an exception mid-step may leave layers gathered
        grad_norm = state.clip_grad_norm(model, max_norm=self.optimizer_config.max_grad_norm)
        return step.finish_step(
            optimizer,
            self.optimizer_config,
            grad_norm=grad_norm,
            losses=losses.values,
            replayed=do_replay,
            routes=plan.in_batch_order(routes) if capture_routes else None,
        )

    # ---- helpers ------------------------------------------------------------------

    def _accumulate(
        self,
        micro: list[TrainingBatch],
        losses: step.MicrobatchLosses,
        routes: list[torch.Tensor],
        *,
        replay: bool,
        entropy: bool,
        capture: bool,
    ) -> None:
        """Forward and backward of every microbatch, each inside its replay session, the
        loss from ``losses``; the captured routes appended to ``routes``."""
        model, count = self._require_model(), len(micro)
        for m, mb in enumerate(micro):
            layout = self._layout(mb)
            # One reduce-scatter per step, after the last microbatch's backward; the
            # gradients accumulate unsharded until then.
            model.set_requires_gradient_sync(m == count - 1)
            with self.gates.session(
                routes=layout.routes if replay else None, capture=capture
            ) as recorder:
                lp, ent = score_responses(
                    self._logits(layout), layout, mb, entropy=entropy, temperature=self.temperature
                )
                value = losses(m, lp, ent, mb)
                # Each loss times 1/microbatches: the gradients accumulate to their
                # mean (algorithms/token_mean.py).
                (value / count).backward()
            if capture:
                routes.append(layout.to_batch_layout(recorder.routes()))

    def _microbatches(
        self, batch: TrainingBatch, size: int | MicrobatchPlan | None
    ) -> list[TrainingBatch]:
        micro = split_microbatches(batch, size)
        # Every forward all-gathers each layer: a rank with fewer microbatches would
        # leave the others waiting forever, so a mismatch is refused on every rank.
        state.require_same_count(len(micro), what="microbatches", device=self.device)
        return micro

    def _layout(self, microbatch: TrainingBatch) -> ContiguousBatch | PackedBatch:
        """The rows as the model runs them (packed under ``remove_microbatch_padding``)."""
        if self.remove_microbatch_padding:
            return pack_rows(microbatch, pad_token_id=self.pad_token_id)
        return make_contiguous(microbatch, pad_token_id=self.pad_token_id)

    def _logits(self, layout: ContiguousBatch | PackedBatch) -> torch.Tensor:
        """``[b, S, V]`` logits of the contiguous rows: positions 0..S-1 and transformers'
        plain causal mask (real tokens first, so right padding never reaches them); for
        a packed row ``[1, T, V]``, attention within each document (``fsdp/packed.py``)."""
        model = self._require_model()
        if isinstance(layout, PackedBatch):
            return model(**packed_attention.model_kwargs(layout, self.device)).logits
        rows, seq = layout.tokens.shape
        tokens = layout.tokens.to(self.device)
        positions = torch.arange(seq, device=self.device)[None, :].expand(rows, seq)
        return model(input_ids=tokens, position_ids=positions).logits

    def _require_model(self) -> Any:
        if self.model is None:
            raise RuntimeError("FSDPPolicyWorker: call setup() first")
        return self.model

    def _require_gates(self) -> Any:
        self._require_model()
        return self.gates

    def _check_replay(
        self,
        batch: TrainingBatch,
        replay_routes: bool | None,
        trajectory_ids: Sequence[str] | None,
    ) -> bool:
        return step.check_replay(
            batch,
            replay_routes,
            self._require_gates(),
            routing_replay=self.routing_replay,
            trajectory_ids=trajectory_ids,
        )
