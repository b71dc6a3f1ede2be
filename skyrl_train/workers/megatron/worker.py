"""The Megatron-core policy worker: forward log-probs, train steps, weight export, R3.

Every forward and every train step runs through Megatron's own schedules
(``get_forward_backward_func``: no pipelining, 1F1B, or interleaved with virtual
stages), on CPU too (``cpu_compat``). The optimizer is ``torch.optim.AdamW``: Megatron's
optimizer wrapper hard-codes CUDA. Data-parallel gradients are averaged by hand over
Megatron's groups, the way its DDP scales them (dense and expert grads both by
1/dp_size).

Expert parallelism with the allgather dispatcher gathers every EP rank's tokens, so
all ranks of an EP group must run the same number of microbatches of the same shape.
With pipeline parallelism every microbatch of a schedule is padded to one shape (stages
exchange fixed-shape activations), the losses and log-probs exist on the last stage
and are broadcast to the others, and routes captured on each stage are gathered so
every rank sees all MoE layers.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from inference.models.architecture import MoEArchitecture
from skyrl_train.algorithms.mismatch import RouterAgreement, router_agreement
from skyrl_train.config.constraints import check_constraints
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.dataset.batch import TrainingBatch, batch_to, slice_batch
from skyrl_train.errors import ConfigValidationError, RouteReplayError
from skyrl_train.workers.megatron import convert, replay
from skyrl_train.workers.megatron.cpu_compat import apply_cpu_compat
from skyrl_train.workers.megatron.layout import (
    ContiguousBatch,
    filler_rows,
    make_contiguous,
    pad_rows,
    response_logprobs,
    response_logprobs_and_entropy,
    route_filler_tensor,
    shift_rows,
)
from skyrl_train.workers.megatron.model import (
    MEGATRON_CONFIG_KEY,
    build_model_chunks,
    build_transformer_config,
    causal_attention_mask,
    init_parallel_state,
)
from skyrl_train.workers.megatron.pipeline import PipelineGroup

LossFn = Callable[[torch.Tensor, TrainingBatch], torch.Tensor]
"""``loss_fn(logprobs [b, R], microbatch) -> scalar``."""
EntropyLossFn = Callable[[torch.Tensor, TrainingBatch, torch.Tensor], torch.Tensor]
"""``loss_fn(logprobs [b, R], microbatch, entropy [b, R]) -> scalar`` (``entropy=True``)."""


ADAM_EPS = 1e-8
"""AdamW's epsilon (torch's and megatron-core's default); no config key sets it."""


@dataclass
class ForwardResult:
    logprobs: torch.Tensor
    """[B, R] fp32 response-token logprobs, 0 where response_mask is 0."""
    routes: torch.Tensor | None = None
    """[B, S, L_moe, K] experts each router of the model dispatched to (ascending ids), in
    the batch's own layout; only when ``capture_routes=True``. Padding rows are arange(K)."""
    entropy: torch.Tensor | None = None
    """[B, R] fp32 entropy (nats) of the model's full next-token distribution at each
    response position, 0 where response_mask is 0; only when ``entropy=True``."""


@dataclass
class _ScheduleOutput:
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    losses: torch.Tensor | None = None
    """[M] each real microbatch's loss (forward and backward only)."""
    routes: torch.Tensor | None = None


@dataclass
class TrainStepResult:
    loss: float
    """Mean of the microbatch losses."""
    grad_norm: float
    """Global gradient norm before clipping."""
    num_microbatches: int
    replayed: bool
    lr: float
    """The learning rate this step used (warmup included)."""
    routes: torch.Tensor | None = None
    """[B, S, L_moe, K] experts each router of the model dispatched to in the update's
    forward (as ``ForwardResult.routes``); only when ``capture_routes=True``."""


class MegatronPolicyWorker:
    """One rank's policy model. Build with the checkpoint's architecture and the
    ``trainer.policy.megatron_config`` node, then ``setup()``. Routes are
    ``[B, S, L_moe, K]``: MoE layers only, every stage's."""

    replay_driver: Callable[[replay.LocalRouters, Sequence[torch.Tensor]], Any] = replay.KeyedReplay
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
    ) -> None:
        # A node built in Python skipped Hydra and validate_cfg: refuse a bad one here.
        check_constraints(megatron_config, prefix=MEGATRON_CONFIG_KEY)
        self.architecture = architecture
        self.megatron_config = megatron_config
        self.optimizer_config = optimizer if optimizer is not None else OptimizerConfig()
        """``trainer.policy.optimizer_config``; a ``max_grad_norm`` <= 0 (tests only: the
        schema wants > 0) disables clipping."""
        self.seed = seed
        self.pad_token_id = pad_token_id
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
        config = build_transformer_config(self.architecture, self.megatron_config)
        init_parallel_state(self.megatron_config, seed=self.seed)
        self.chunks = build_model_chunks(self.architecture, config, seed=self.seed)
        self.model = self.chunks[0] if len(self.chunks) == 1 else torch.nn.ModuleList(self.chunks)
        self._pipeline = PipelineGroup.current()
        self.routers = replay.local_routers(self.chunks)
        if self.routers.moe_layers != self.architecture.moe_layers:
            # The engine's routes cover the checkpoint's MoE layers; a passthrough
            # moe_layer_freq that builds others would replay them into the wrong layers.
            raise ConfigValidationError(
                f"{MEGATRON_CONFIG_KEY}.transformer_config_kwargs.moe_layer_freq",
                f"expected MoE layers {list(self.architecture.moe_layers)} (the "
                f"checkpoint's), got {list(self.routers.moe_layers)}",
            )
        opt = self.optimizer_config
        beta1, beta2 = opt.adam_betas
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            betas=(beta1, beta2),
            eps=ADAM_EPS,
        )
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
        if weights.keys() != params.keys():
            missing = sorted(params.keys() - weights.keys())[:3]
            extra = sorted(weights.keys() - params.keys())[:3]
            raise ValueError(
                f"weights: expected this model's {len(params)} parameters, got "
                f"{len(weights)} (missing {missing}, unexpected {extra})"
            )
        own: dict[str, torch.Tensor] = {}
        try:
            for name, param in params.items():
                if weights[name].shape != param.shape:
                    raise ValueError(
                        f"weights[{name!r}]: expected shape {tuple(param.shape)}, got "
                        f"{tuple(weights[name].shape)}"
                    )
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

    # ---- forward ----------------------------------------------------------------

    def forward(
        self,
        batch: TrainingBatch,
        *,
        micro_batch_size: int | None = None,
        replay_routes: bool | None = None,
        capture_routes: bool = False,
        trajectory_ids: Sequence[str] | None = None,
        entropy: bool = False,
    ) -> ForwardResult:
        """Response logprobs ``[B, R]`` without gradient, microbatch by microbatch.

        ``replay_routes=None`` replays when the config enables it and the batch has routes.
        ``entropy=True`` also returns each response position's full-vocabulary entropy.
        """
        do_replay = self._check_replay(batch, replay_routes, trajectory_ids)
        micro = list(self._microbatches(batch, micro_batch_size))
        self._require_model().eval()
        with torch.no_grad():
            out = self._schedule(
                micro, loss_fn=None, do_replay=do_replay, capture=capture_routes, entropy=entropy
            )
        assert out.logprobs is not None
        return ForwardResult(
            logprobs=out.logprobs,
            routes=out.routes if capture_routes else None,
            entropy=out.entropy if entropy else None,
        )

    def forward_logprobs(self, batch: TrainingBatch, **options: Any) -> torch.Tensor:
        """``forward(batch, **options).logprobs``: ``[B, R]`` fp32."""
        return self.forward(batch, **options).logprobs

    def record_routes(
        self, batch: TrainingBatch, *, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """The trainer's own top-k (Megatron RECORD mode, router order) as
        ``[B, S, L_moe, K]`` in the batch layout; needs replay enabled on the model."""
        micro = list(self._microbatches(batch, micro_batch_size))
        self._require_model().eval()
        with torch.no_grad():
            out = self._schedule(
                micro, loss_fn=None, do_replay=False, capture=False, entropy=False, record=True
            )
        assert out.routes is not None
        return out.routes

    def router_agreement(
        self,
        batch: TrainingBatch,
        *,
        replay_routes: bool,
        micro_batch_size: int | None = None,
    ) -> float:
        """Share of real token-layer selections (router_padding_mask False) where the
        trainer dispatched to the same experts as the rollout's routes."""
        result = self.forward(
            batch,
            micro_batch_size=micro_batch_size,
            replay_routes=replay_routes,
            capture_routes=True,
        )
        assert result.routes is not None
        return self.rollout_router_agreement(batch, result.routes).agreement

    def rollout_router_agreement(
        self, batch: TrainingBatch, routes: torch.Tensor
    ) -> RouterAgreement:
        """Agreement of ``routes`` (``ForwardResult.routes``: every MoE layer) with the
        batch's rollout routes over real rows the rollout captured, with the
        token-layer count that weights it across data-parallel ranks."""
        if batch.routed_experts is None:
            raise RouteReplayError("routed_experts: expected routes to compare against, got None")
        replay.check_route_shape(batch.routed_experts, self._require_routers())
        skip = ~batch.attention_mask.to(torch.bool)
        if batch.router_padding_mask is not None:
            skip = skip | batch.router_padding_mask.to(torch.bool)
        return router_agreement(routes, batch.routed_experts, skip)

    # ---- training -----------------------------------------------------------------

    def train_step(
        self,
        batch: TrainingBatch,
        *,
        loss_fn: LossFn | EntropyLossFn,
        micro_batch_size: int,
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
        micro = list(self._microbatches(batch, micro_batch_size))
        model.train()
        optimizer.zero_grad(set_to_none=True)
        out = self._schedule(
            micro, loss_fn=loss_fn, do_replay=do_replay, capture=capture_routes, entropy=entropy
        )
        self._sync_gradients()
        grad_norm = self._clip_gradients()
        # A NaN norm passes the clip (NaN > limit is False) and AdamW would write NaN
        # into every parameter it touches; skipped, the weights stay as they were and
        # the trainer stops the run on the reported norm (trainer/finite.py).
        lr = self._warmed_up_lr(optimizer)
        if math.isfinite(grad_norm):
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        assert out.losses is not None
        return TrainStepResult(
            loss=float(out.losses.mean()),
            grad_norm=grad_norm,
            num_microbatches=len(micro),
            replayed=do_replay,
            lr=lr,
            routes=out.routes if capture_routes else None,
        )

    # ---- the schedule -----------------------------------------------------------------

    def _schedule(
        self,
        micro: list[TrainingBatch],
        *,
        loss_fn: LossFn | EntropyLossFn | None,
        do_replay: bool,
        capture: bool,
        entropy: bool,
        record: bool = False,
    ) -> _ScheduleOutput:
        """Run ``micro`` through Megatron's schedule for this parallel layout.

        ``loss_fn=None``: forward only, keeping each microbatch's logprobs (and
        entropy); otherwise forward and backward, keeping each microbatch's loss. The
        microbatches' count and shape are padded as the pipeline needs (a padding
        microbatch's loss is a zero that keeps the graph).
        """
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        routers = self._require_routers()
        layouts = [make_contiguous(mb, pad_token_id=self.pad_token_id) for mb in micro]
        count, rows = len(micro), max(mb.batch_size for mb in micro)
        inputs, total = layouts, count
        if self._pipeline.size > 1:
            inputs = [pad_rows(layout, rows, pad_token_id=self.pad_token_id) for layout in layouts]
            total = self._pipeline.padded_count(count)
            blank = filler_rows(layouts[0], rows, pad_token_id=self.pad_token_id)
            inputs = inputs + [blank] * (total - count)
        # Megatron divides each microbatch's loss by the (padded) count; the worker's
        # contract is a mean over the real ones.
        scale = total / count
        logprobs: list[torch.Tensor | None] = [None] * count
        entropies: list[torch.Tensor | None] = [None] * count
        losses = torch.zeros(count, dtype=torch.float64)
        recorded: dict[int, dict[int, torch.Tensor]] = {}  # as DispatchCapture.got
        driver = None
        if do_replay:  # _check_replay saw routes, so every layout has them
            driver = self.replay_driver(routers, [_routes_of(layout) for layout in inputs])
        capturer = replay.DispatchCapture(routers) if capture else None

        def loss_func(m: int, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            if m >= count:
                return logits.sum() * 0.0, {}
            mb, layout = micro[m], layouts[m]
            logits = logits[: mb.batch_size]
            extra: tuple[torch.Tensor, ...] = ()
            if entropy:
                lp, ent = response_logprobs_and_entropy(logits, layout, mb.response_mask)
                extra = (ent,)
            else:
                lp = response_logprobs(logits, layout, mb.response_mask)
            if loss_fn is None:
                logprobs[m] = lp.cpu()
                entropies[m] = extra[0].cpu() if extra else None
                return torch.zeros(()), {}
            loss = loss_fn(lp, batch_to(mb, lp.device), *extra)  # type: ignore[arg-type]
            losses[m] = float(loss.detach())
            return loss * scale, {}

        def forward_step(data: Iterator[tuple[int, int]], model: Any) -> tuple[Any, Any]:
            chunk, m = next(data)
            layout = inputs[m]
            batch_rows, seq = layout.tokens.shape
            if driver is not None:
                driver.arm(chunk, m)
            if capturer is not None:
                capturer.begin(m, batch=batch_rows, seq=seq)
            try:
                output = self._chunk_forward(model, layout)
            finally:
                if capturer is not None:
                    capturer.end()
            if record:
                recorded.setdefault(m, {}).update(
                    replay.recorded_routes(routers, chunk, batch=batch_rows, seq=seq)
                )
            if driver is not None and output.requires_grad:
                output.register_hook(lambda _grad: driver.on_backward(chunk, m))
            return output, functools.partial(loss_func, m)

        chunks = self._require_chunks()
        iterators = [iter([(c, m) for m in range(total)]) for c in range(len(chunks))]
        session = (
            replay.replay_session(routers, record=record)
            if do_replay or record
            else contextlib.nullcontext()
        )
        try:
            with session:
                get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iterators if len(chunks) > 1 else iterators[0],
                    model=chunks if len(chunks) > 1 else chunks[0],
                    num_microbatches=total,
                    seq_length=inputs[0].tokens.shape[1],
                    micro_batch_size=rows,
                    forward_only=loss_fn is None,
                )
        finally:
            if capturer is not None:
                capturer.close()
        routes = None
        if capturer is not None or record:
            per_router = capturer.got if capturer is not None else recorded
            routes = self._gather_routes(micro, layouts, per_router)
        if loss_fn is not None:
            return _ScheduleOutput(losses=self._pipeline.from_last_stage(losses), routes=routes)
        shapes = [(mb.batch_size, mb.response_mask.shape[1]) for mb in micro]
        got = self._pipeline.tensors_from_last_stage(logprobs, shapes)
        ents = self._pipeline.tensors_from_last_stage(entropies, shapes) if entropy else None
        return _ScheduleOutput(
            logprobs=torch.cat(got),
            entropy=torch.cat(ents) if ents is not None else None,
            routes=routes,
        )

    def _gather_routes(
        self,
        micro: list[TrainingBatch],
        layouts: list[ContiguousBatch],
        got: Mapping[int, Mapping[int, torch.Tensor]],
    ) -> torch.Tensor:
        """``[B, S, L_moe, K]`` in the batch layout from each microbatch's per-router
        ``[b_padded, S, K]``: every stage fills its own MoE layers, the pipeline group
        sums the rest in (disjoint layers, zeros elsewhere)."""
        routers = self._require_routers()
        parts = []
        for m, (mb, layout) in enumerate(zip(micro, layouts, strict=True)):
            local = torch.stack(
                [got[m][i][: mb.batch_size] for i in range(len(routers.modules))], dim=2
            )
            local = self._to_batch_layout(local, layout)
            full = torch.zeros(
                *local.shape[:2], routers.num_layers, local.shape[3], dtype=local.dtype
            )
            full[:, :, list(routers.route_layers)] = local
            parts.append(full)
        return self._pipeline.sum_over_stages(torch.cat(parts))

    def _warmed_up_lr(self, optimizer: torch.optim.Optimizer) -> float:
        opt = self.optimizer_config
        if opt.num_warmup_steps <= 0:
            return opt.lr
        # AdamW's own step count: a resumed run loads it with the optimizer state, so
        # warmup continues where it stopped instead of starting over.
        done = max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)
        return opt.lr * min(1.0, (done + 1) / opt.num_warmup_steps)

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
        """Decide whether to replay and validate the whole batch's routes up front, so
        a bad trajectory is refused before any microbatch ran."""
        routers = self._require_routers()
        if replay_routes is None:
            replay_routes = (
                self.megatron_config.moe_enable_routing_replay and batch.routed_experts is not None
            )
        if not replay_routes:
            return False
        if batch.routed_experts is None:
            raise RouteReplayError("routed_experts: expected routes to replay, got None")
        if not routers.replay_enabled:
            raise RouteReplayError(
                f"{MEGATRON_CONFIG_KEY}.moe_enable_routing_replay: expected True to replay "
                f"routes, got False"
            )
        replay.validate_routes(
            batch.routed_experts,
            routers,
            trajectory_ids=trajectory_ids,
        )
        return True

    def _microbatches(self, batch: TrainingBatch, size: int | None) -> Iterator[TrainingBatch]:
        size = size or batch.batch_size
        if size < 1:
            raise ValueError(f"micro_batch_size: expected a positive int, got {size}")
        for start in range(0, batch.batch_size, size):
            yield slice_batch(batch, start, min(start + size, batch.batch_size))

    def _chunk_forward(self, chunk: Any, layout: ContiguousBatch) -> torch.Tensor:
        """One model chunk's forward: logits ``[b, S, V]`` on the last stage, hidden
        states ``[S, b, H]`` elsewhere (a later stage reads its input from the
        schedule's ``set_input_tensor``, not from the tokens)."""
        rows, seq = layout.tokens.shape
        device = next(chunk.parameters()).device
        # Megatron ignores position_ids for RoPE; they are passed because the
        # signature requires them. padding_mask: GPTModel.forward (0.16) takes [B, S]
        # and hands it, transposed, to every router, where True means *padding* (the
        # z-loss and aux-loss code invert it; the router docstring says the opposite,
        # the code wins). It only masks aux/z losses and expert-bias counts; padding
        # rows still get replayed (arange(K)), since the dropless dispatcher needs
        # tokens*K routes.
        positions = torch.arange(seq, device=device)[None, :].expand(rows, seq)
        return chunk(
            layout.tokens.to(device),
            positions,
            causal_attention_mask(seq, device=device),
            padding_mask=layout.padding_mask.to(device),
        )

    def _to_batch_layout(self, routes: torch.Tensor, layout: ContiguousBatch) -> torch.Tensor:
        filler = route_filler_tensor(routes)
        return shift_rows(routes, -layout.shifts, filler)

    def _sync_gradients(self) -> None:
        from megatron.core import parallel_state

        dp_size = parallel_state.get_data_parallel_world_size()
        if dp_size == 1:
            return
        dense_group = parallel_state.get_data_parallel_group()
        expert_group = parallel_state.get_expert_data_parallel_group()
        for param in self._require_model().parameters():
            if param.grad is None:
                continue
            is_expert = not getattr(param, "allreduce", True)
            group = expert_group if is_expert else dense_group
            if torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(param.grad, group=group)
            param.grad.div_(dp_size)

    def _clip_gradients(self) -> float:
        """Global L2 norm (expert shards summed over the EP group, stages over the
        pipeline group), then clip."""
        from megatron.core import parallel_state

        dense_sq = torch.zeros((), dtype=torch.float64)
        expert_sq = torch.zeros((), dtype=torch.float64)
        params = [p for p in self._require_model().parameters() if p.grad is not None]
        for p in params:
            sq = p.grad.detach().double().pow(2).sum().cpu()
            if getattr(p, "allreduce", True):
                dense_sq += sq
            else:
                expert_sq += sq
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(
                expert_sq, group=parallel_state.get_expert_model_parallel_group()
            )
        # Each stage holds its own layers: the squares add up over the pipeline group.
        norm = math.sqrt(float(self._pipeline.sum_over_stages(dense_sq + expert_sq)))
        limit = self.optimizer_config.max_grad_norm
        if limit > 0 and norm > limit:
            scale = limit / (norm + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        return norm


def _routes_of(layout: ContiguousBatch) -> torch.Tensor:
    assert layout.routes is not None
    return layout.routes
