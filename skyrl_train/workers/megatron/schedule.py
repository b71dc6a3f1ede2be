"""One pass of a batch's microbatches through Megatron's own schedule.

``get_forward_backward_func`` picks the schedule for the parallel layout (no
pipelining, 1F1B, or interleaved with virtual stages); this module feeds it. What a
caller wants from the logits (log-probs to keep, or a loss to back-propagate) is its
``head``; whether routes are replayed or captured is what it passes in. Nothing here
knows about losses, optimizers or the trainer, beyond the microbatch weighting the
loss normalisation asks of every backend (``algorithms/token_mean.py``).

Under pipeline parallelism stages exchange fixed-shape activations, so every
microbatch is padded to the largest one's rows, and the interleaved schedule needs a
microbatch count it can group, so filler microbatches are appended
(``PipelineGroup.padded_count``). A filler's loss is a zero that keeps the graph.

Packed (``trainer.remove_microbatch_padding``): each microbatch is one row
(``packed_layout.PackedBatch``) run as THD with ``PackedSeqParams``; its tail padding
(sequence parallelism's multiple, a pipeline's one length, or the longest packed row
of the token-exchange group) is its own document and padding for the routers
(``megatron/packed_rows.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from skyrl_train.algorithms.token_mean import microbatch_loss_weight
from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.errors import RouteReplayError
from skyrl_train.workers.megatron import replay
from skyrl_train.workers.megatron.layout import (
    filler_rows,
    make_contiguous,
    pad_columns,
    pad_rows,
)
from skyrl_train.workers.megatron.model import causal_attention_mask
from skyrl_train.workers.megatron.packed_rows import (
    ScheduledLayout,
    pack_microbatches,
    packed_forward,
)
from skyrl_train.workers.megatron.pipeline import PipelineGroup
from skyrl_train.workers.microbatches import MicrobatchPlan
from skyrl_train.workers.packed_layout import PackedBatch

Head = Callable[[int, torch.Tensor], torch.Tensor]
"""``head(m, logits [b, S, V]) -> scalar`` for real microbatch ``m`` (its own rows
only). A forward-only pass keeps what it needs from the logits and returns a zero."""


class ReplayDriver(Protocol):
    """Puts microbatch ``m``'s routes into ``chunk``'s routers (``replay.KeyedReplay``)."""

    def arm(self, chunk: int, microbatch: int) -> None: ...

    def on_backward(self, chunk: int, microbatch: int) -> None: ...


ReplayDriverFactory = Callable[[replay.LocalRouters, Sequence[torch.Tensor]], ReplayDriver]


@dataclass
class Microbatches:
    """A batch's microbatches as the schedule runs them."""

    micro: list[TrainingBatch]
    """The real microbatches, in the plan's order."""
    layouts: list[ScheduledLayout]
    """Each real microbatch left-packed (``make_contiguous``), its own rows only; or,
    packed, its one row as fed (``inputs[m]``)."""
    inputs: list[ScheduledLayout]
    """What the schedule feeds: ``layouts`` widened to a multiple of the
    sequence-parallel size, and, when pipelining, padded to one row count and followed
    by filler microbatches; ``layouts`` itself when neither applies."""
    plan: MicrobatchPlan | None = None
    """The batch's rows in each microbatch (None: consecutive, in batch order)."""

    @property
    def packed(self) -> bool:
        return bool(self.inputs) and isinstance(self.inputs[0], PackedBatch)

    def in_batch_order(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-microbatch ``[b_m, ...]`` results joined in the batch's row order."""
        return self.plan.in_batch_order(parts) if self.plan is not None else torch.cat(list(parts))

    @classmethod
    def prepare(
        cls,
        micro: list[TrainingBatch],
        pipeline: PipelineGroup,
        *,
        pad_token_id: int,
        sequence_shards: int = 1,
        plan: MicrobatchPlan | None = None,
        packed: bool = False,
        exchange_group: Any = None,
    ) -> Microbatches:
        """``sequence_shards``: sequence-parallel ranks; each input's width is padded
        to a multiple of it, since Megatron splits the sequence evenly. ``packed``:
        one row per microbatch (``packed_rows.pack_microbatches``; ``exchange_group``,
        the ranks whose dispatcher exchanges tokens, agree on each packed length)."""
        if packed:
            rows: list[ScheduledLayout] = list(
                pack_microbatches(
                    micro,
                    pipeline,
                    pad_token_id=pad_token_id,
                    sequence_shards=sequence_shards,
                    exchange_group=exchange_group,
                )
            )
            return cls(micro=micro, layouts=rows[: len(micro)], inputs=rows, plan=plan)
        layouts = [make_contiguous(mb, pad_token_id=pad_token_id) for mb in micro]
        inputs = [
            pad_columns(layout, sequence_shards, pad_token_id=pad_token_id) for layout in layouts
        ]
        if pipeline.size > 1:
            most = max(mb.batch_size for mb in micro)
            inputs = [pad_rows(layout, most, pad_token_id=pad_token_id) for layout in inputs]
            blank = filler_rows(inputs[0], most, pad_token_id=pad_token_id)
            inputs = inputs + [blank] * (pipeline.padded_count(len(micro)) - len(micro))
        return cls(micro=micro, layouts=list(layouts), inputs=list(inputs), plan=plan)

    @property
    def count(self) -> int:
        return len(self.micro)

    @property
    def total(self) -> int:
        return len(self.inputs)


def run_schedule(
    chunks: list[Any],
    routers: replay.LocalRouters,
    batches: Microbatches,
    *,
    head: Head,
    forward_only: bool,
    replay_driver: ReplayDriverFactory | None = None,
    capture: bool = False,
) -> dict[int, dict[int, torch.Tensor]] | None:
    """Run every microbatch through ``chunks`` (this rank's model chunks).

    ``replay_driver``: replay each microbatch's routes (the layouts must carry them).
    ``capture``: return what each router dispatched, as ``DispatchCapture.got``
    (microbatch -> local router index -> ``[b_padded, S, K]``), for ``gather_routes``.
    The routers' replay state is clean on return, an exception included.
    """
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    count, total = batches.count, batches.total
    # Megatron divides each microbatch's loss by the (padded) count; the backends'
    # contract (algorithms/token_mean.py) is a mean over the real ones.
    scale = microbatch_loss_weight(microbatches=count, divided_by=total)
    driver = None
    if replay_driver is not None:
        driver = replay_driver(routers, [_routes_of(layout) for layout in batches.inputs])
    capturer = replay.DispatchCapture(routers) if capture else None

    def loss_func(m: int, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        if m >= count:
            return logits.sum() * 0.0, {}
        if batches.packed:  # one row holding every trajectory of the microbatch
            return head(m, logits) * scale, {}
        return head(m, logits[: batches.micro[m].batch_size]) * scale, {}

    def forward_step(data: Iterator[tuple[int, int]], model: Any) -> tuple[Any, Any]:
        chunk, m = next(data)
        layout = batches.inputs[m]
        rows, seq = layout.tokens.shape
        if driver is not None:
            driver.arm(chunk, m)
        if capturer is not None:
            capturer.begin(m, batch=rows, seq=seq)
        try:
            output = chunk_forward(model, layout)
        finally:
            if capturer is not None:
                capturer.end()
        if driver is not None and output.requires_grad:
            output.register_hook(lambda _grad: driver.on_backward(chunk, m))
        return output, functools.partial(loss_func, m)

    iterators = [iter([(c, m) for m in range(total)]) for c in range(len(chunks))]
    session = replay.replay_session(routers) if driver is not None else contextlib.nullcontext()
    try:
        with session:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(chunks) > 1 else iterators[0],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=total,
                seq_length=batches.inputs[0].tokens.shape[1],
                micro_batch_size=(
                    1 if batches.packed else max(mb.batch_size for mb in batches.micro)
                ),
                forward_only=forward_only,
            )
    finally:
        if capturer is not None:
            capturer.close()
    return capturer.got if capturer is not None else None


def chunk_forward(chunk: Any, layout: ScheduledLayout) -> torch.Tensor:
    """One model chunk's forward: logits ``[b, S, V]`` on the last stage, hidden states
    ``[S, b, H]`` elsewhere (a later stage reads its input from the schedule's
    ``set_input_tensor``, not from the tokens). A packed row: ``packed_forward``."""
    if isinstance(layout, PackedBatch):
        return packed_forward(chunk, layout)
    rows, seq = layout.tokens.shape
    device = next(chunk.parameters()).device
    # Megatron ignores position_ids for RoPE; they are passed because the signature
    # requires them. padding_mask: GPTModel.forward (0.16) takes [B, S] and hands it,
    # transposed, to every router, where True means *padding* (the z-loss and aux-loss
    # code invert it; the router docstring says the opposite, the code wins). It only
    # masks aux/z losses and expert-bias counts; padding rows still get replayed
    # (arange(K)), since the dropless dispatcher needs tokens*K routes.
    positions = torch.arange(seq, device=device)[None, :].expand(rows, seq)
    return chunk(
        layout.tokens.to(device),
        positions,
        causal_attention_mask(seq, device=device),
        padding_mask=layout.padding_mask.to(device),
    )


def gather_routes(
    routers: replay.LocalRouters,
    pipeline: PipelineGroup,
    batches: Microbatches,
    got: Mapping[int, Mapping[int, torch.Tensor]],
) -> torch.Tensor:
    """``[B, S, L_moe, K]`` in the batch layout (and the batch's row order) from
    ``run_schedule``'s capture: every stage fills its own MoE layers, the pipeline group
    sums the rest in (disjoint layers, zeros elsewhere)."""
    parts = []
    for m, (mb, layout) in enumerate(zip(batches.micro, batches.layouts, strict=True)):
        seen = got.get(m, {})
        for i in range(len(routers.modules)):
            if i not in seen:  # a hook that never fired: no forward reached that router
                where = routers.describe_layer(routers.route_layers[i])
                raise RouteReplayError(
                    f"dispatched routes, {where}, microbatch {m}",
                    expected="the router to dispatch in the forward",
                    got="nothing",
                )
        if isinstance(layout, PackedBatch):
            # [1, T, L_local, K] on the packed row, its tail dropped by to_batch_layout.
            local = torch.stack([seen[i] for i in range(len(routers.modules))], dim=2)
        else:
            seq = layout.tokens.shape[1]  # the input's sequence-parallel padding dropped
            local = torch.stack(
                [seen[i][: mb.batch_size, :seq] for i in range(len(routers.modules))], dim=2
            )
        local = layout.to_batch_layout(local)
        full = torch.zeros(*local.shape[:2], routers.num_layers, local.shape[3], dtype=local.dtype)
        full[:, :, list(routers.route_layers)] = local
        parts.append(full)
    return pipeline.sum_over_stages(batches.in_batch_order(parts))


def _routes_of(layout: ScheduledLayout) -> torch.Tensor:
    assert layout.routes is not None
    return layout.routes
