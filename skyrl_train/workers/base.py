"""What the trainer asks of one rank's policy worker, whatever the backend runs it.

``PolicyWorker`` is the contract between ``trainer/policy.py`` (one trainer rank) and
either backend, ``workers/megatron`` or ``workers/fsdp`` (built by
``workers/factory.py``): every call the trainer makes on its worker, and nothing else.
``RankInfo`` is where a rank sits in its backend's groups; the result types are plain
dataclasses of CPU tensors and floats; ``check_swapped_weights`` is the shared refusal
of ``swapped_weights``. Importing this module loads no backend.

Gradient contract (``train_step``); how the three factors of the loss normalisation
make every step a token mean over the global mini-batch is written out once, in
``algorithms/token_mean.py``, and this is the worker's side of it:

- One call is one optimizer step over the rank's shard ``batch``: gradients are zeroed,
  then every microbatch runs forward and backward. Microbatches are the row groups of
  ``micro_batch_size``, a ``workers/microbatches.MicrobatchPlan`` (by a row count or a
  token budget, rows possibly reordered, its ``count`` the same on every rank: the
  trainer agrees it, ``trainer/microbatch_plan.py``), or for an int consecutive slices
  of that many rows, the last one shorter; none splitting a row. Per-row results
  (logprobs, entropy, routes) come back in the batch's row order whatever the plan.
- The microbatches' gradients accumulate as their mean (each loss times
  1 / microbatches), and ``TrainStepResult.loss`` is the mean of the microbatch losses.
- Each gradient is then summed over its data-parallel group (for a Megatron expert
  parameter, the expert-data-parallel one: the ranks holding the same experts) and
  divided by the dense data-parallel size ``dp_size``, experts included, as
  Megatron's DDP scales them and FSDP2's reduce-scatter averages. Under Megatron,
  gradients of weights that tensor-parallel ranks hold whole but feed from their own
  shard of the data (sequence-parallel norms and routers, q/k norms) are summed over
  the tensor-parallel group first.
- ``TrainStepResult.grad_norm`` is the global L2 norm before clipping, over every
  shard of the model (tensor, expert and pipeline parallel), equal on every rank.
  Gradients are scaled down to ``trainer.policy.optimizer_config.max_grad_norm`` when
  the norm is above it.
- The optimizer steps once per call, and only when the norm is finite: a NaN or inf
  norm leaves the weights as they were and the trainer stops the run on the reported
  norm (``trainer/finite.py``). The step's learning rate (``TrainStepResult.lr``)
  follows the warm-up from the optimizer's own step count, so a resumed run goes on
  where it stopped; ``scheduled_lr`` is the rate the next step would use.

Route contract (``forward`` and ``train_step``):

- Routes are ``[B, S, L_moe, K]`` integer expert ids aligned column for column with
  ``batch.sequences`` (``S = P + R``, the left-padded prompt then the response), one
  layer per MoE layer of the whole model (``architecture.moe_layers``, every pipeline
  stage's), ``K`` the router's top-k.
- ``replay_routes=True`` replays ``batch.routed_experts`` at every position of every
  row: prompt and observation tokens too (the loss mask does not select them), and
  padding or uncaptured positions, which hold ``inference.wire.route_filler``
  (``arange(K)``) and are True in ``batch.router_padding_mask``. Only the discrete
  selection is replayed: the routing weights are the live router's scores at the
  replayed ids, so the router still gets gradients. The whole batch's routes are
  validated before any microbatch runs (shape against the model, ids in
  ``[0, num_experts)``, ``K`` distinct ids per position; ``workers/routes.py``), a bad
  one refused with ``RouteReplayError``.
- ``capture_routes=True`` returns what each router dispatched in the forward (never a
  backward recompute) in the same layout, ids ascending, padding positions
  ``arange(K)``.
- R3 and R2 are the trainer's choice, not the worker's, made once per step
  (``trainer/replay_plan.py``): under R3 (``trainer.policy.routing_replay.source=
  rollout``) the trainer replays the rollout's routes in the old-logprob forward and
  every update; under R2 (``old_policy``) it captures the old-logprob forward's own
  routes (native routing), puts them on a copy of the batch with only the padding
  columns masked, and replays them in every update. The worker replays whatever routes
  the batch carries (docs/r3-and-pipeline.md); a worker built with
  ``routing_replay=False`` refuses a replay naming ``trainer.policy.routing_replay.enabled``.

Both backends' ``train_step`` share one body (``workers/step.py``: the replay check,
each microbatch's loss, the step's end); each keeps its own schedule and gradient
reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from inference.models.architecture import MoEArchitecture
from skyrl_train.algorithms.mismatch import RouterAgreement
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.runs.rank_contract import Checkpointable, ParallelLayout
from skyrl_train.workers.microbatches import MicrobatchPlan

LossFn = Callable[[torch.Tensor, TrainingBatch], torch.Tensor]
"""``loss_fn(logprobs [b, R], microbatch) -> scalar``."""
EntropyLossFn = Callable[[torch.Tensor, TrainingBatch, torch.Tensor], torch.Tensor]
"""``loss_fn(logprobs [b, R], microbatch, entropy [b, R]) -> scalar`` (``entropy=True``)."""


@dataclass(frozen=True)
class RankInfo:
    """Where a trainer rank sits in its backend's parallel groups, read after setup."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    ep_size: int
    pp_rank: int = 0
    pp_size: int = 1
    tp_size: int = 1
    collective_export: bool = False
    """``export_weights`` gathers shards from other ranks (experts, stages, tensor or
    FSDP shards), so every rank must consume it in lockstep, a rank that neither
    pushes nor writes included."""
    layout: ParallelLayout | None = None
    """The layout the backend runs (``runs.rank_contract``), which the trainer records
    in its rank files and a resume compares; None only for a worker that never saves
    (a test's stand-in)."""

    @property
    def is_last_stage(self) -> bool:
        """The pipeline stage whose loss function ran: its metrics are the complete ones
        (clip fraction and TIS weights are counted inside the loss)."""
        return self.pp_rank == self.pp_size - 1


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


def check_swapped_weights(
    params: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]
) -> None:
    """Refuse ``weights`` for ``PolicyWorker.swapped_weights`` unless they name exactly
    the model's parameters (``params``), each with its shape; before anything swaps."""
    if weights.keys() != params.keys():
        missing = sorted(params.keys() - weights.keys())[:3]
        extra = sorted(weights.keys() - params.keys())[:3]
        raise ValueError(
            f"weights: expected this model's {len(params)} parameters, got "
            f"{len(weights)} (missing {missing}, unexpected {extra})"
        )
    for name, param in params.items():
        if weights[name].shape != param.shape:
            raise ValueError(
                f"weights[{name!r}]: expected shape {tuple(param.shape)}, got "
                f"{tuple(weights[name].shape)}"
            )


@runtime_checkable
class PolicyWorker(Checkpointable, Protocol):
    """One trainer rank's policy model: the calls ``PolicyTrainer`` makes, with the
    gradient and route contracts of this module's docstring. Built and set up by
    ``workers.factory.build_worker``; ``checkpoint_state`` and ``load_checkpoint_state``
    (``runs.rank_contract.Checkpointable``) are the rank's checkpoint.

    With experts, layers or tensors sharded over ranks, ``forward``, ``train_step`` and
    ``export_weights`` are collectives: every rank of those groups calls them in
    lockstep."""

    @property
    def architecture(self) -> MoEArchitecture:
        """The checkpoint's architecture (its family names the engine's weight layout)."""
        ...

    def rank_info(self) -> RankInfo:
        """This rank's place in the parallel groups (after setup)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors in the engine's layout; returns how many."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters (its shards), as the model names them."""
        ...

    def parameter_snapshot(self) -> dict[str, torch.Tensor]:
        """A detached copy of ``named_parameters``, for ``swapped_weights``."""
        ...

    def swapped_weights(self, weights: Mapping[str, torch.Tensor]) -> AbstractContextManager[None]:
        """Run the model on ``weights`` (a ``parameter_snapshot``) inside the block, its
        own weights back on exit (an exception included); routing and replay unchanged."""
        ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model's weights in the engine's HF layout, one tensor at a time."""
        ...

    def forward(
        self,
        batch: TrainingBatch,
        *,
        micro_batch_size: int | MicrobatchPlan | None = None,
        replay_routes: bool | None = None,
        capture_routes: bool = False,
        entropy: bool = False,
        temperature: float | None = None,
        drop_tokens: bool = True,
        trajectory_ids: Sequence[str] | None = None,
    ) -> ForwardResult:
        """Response logprobs without gradient, microbatch by microbatch.
        ``temperature``: None scores under the rollout sampler's; 1.0 with a batch
        without ``sample_support`` gives the raw logits' logprobs. ``drop_tokens=False``:
        no expert drops a token over its capacity (an engine never does); a backend
        without an expert capacity drops none either way. ``trajectory_ids``: one name
        per row (``dataset.batch.trajectory_ids``), which a route refusal gives instead
        of the row's index in this rank's shard."""
        ...

    def rollout_router_agreement(
        self, batch: TrainingBatch, routes: torch.Tensor
    ) -> RouterAgreement:
        """Agreement of ``routes`` (every MoE layer) with ``batch.routed_experts`` over
        real rows the rollout captured (``router_padding_mask`` False)."""
        ...

    def rollout_router_flips(self, batch: TrainingBatch, routes: torch.Tensor) -> torch.Tensor:
        """``[B, S, L_moe]`` bool: where ``routes`` chose other experts than the rollout
        (False where the rollout captured nothing); the rollout dumps' per-token form of
        ``rollout_router_agreement``."""
        ...

    def train_step(
        self,
        batch: TrainingBatch,
        *,
        loss_fn: LossFn | EntropyLossFn,
        micro_batch_size: int | MicrobatchPlan,
        replay_routes: bool | None = None,
        entropy: bool = False,
        capture_routes: bool = False,
        trajectory_ids: Sequence[str] | None = None,
    ) -> TrainStepResult:
        """One optimizer step over ``batch`` (the gradient contract above); with
        ``entropy=True`` ``loss_fn`` also gets the differentiable entropy ``[b, R]``.
        ``trajectory_ids`` as ``forward``'s."""
        ...

    def scheduled_lr(self) -> float:
        """The learning rate the next optimizer step uses (warm-up included)."""
        ...
