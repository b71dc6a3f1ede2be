"""A microbatch packed into one row: no padding for the model's matmuls, routes included.

``trainer.remove_microbatch_padding`` (docs/r3-and-pipeline.md, "Packed batches"). A
microbatch of ``b`` padded rows ``[b, S]`` becomes one row ``[1, T]``, ``T`` the sum
of the rows' real tokens (plus a tail a backend may need: sequence parallelism splits
``T`` evenly, pipeline stages exchange one shape). Each row is one document:

- ``positions`` restart at 0 for every row, so rotary positions are each row's own;
- ``cu_seqlens`` ``[docs + 1]`` int32 are the documents' boundaries, the tail padding
  its own last document, in the form varlen attention kernels take (flash attention's
  ``cu_seqlens_q``, Transformer Engine's THD ``PackedSeqParams``, a document
  ``BlockMask``); attention never crosses them;
- ``routes`` ``[1, T, L, K]`` are the rows' own routes in the same order, so each
  router sees every packed token's replayed experts; the tail holds ``route_filler``
  and is True in ``padding_mask`` (with the rollout's uncaptured tokens), so it stays
  out of replay checks, agreements and the loss.

Response token j of row b sits at ``row_starts[b] + prompt_lens[b] + j``; its log-prob
comes from the logits one position earlier, inside the row (``response_index``), so
scoring is ``batch_layout``'s, the same code as the padded layout's. Nothing here
imports a backend.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from skyrl_train.dataset.batch import TrainingBatch
from skyrl_train.dataset.route_rows import PackedRouteRows, batch_positions, token_offsets
from skyrl_train.workers.batch_layout import aligned_route_rows, route_filler_tensor, row_extents

__all__ = ["PackedBatch", "document_attention", "pack_rows"]


@dataclass(frozen=True)
class PackedBatch:
    """A microbatch's rows packed into one (this module's docstring)."""

    tokens: torch.Tensor
    """[1, T] int64; the tail padding holds the pad token id."""
    positions: torch.Tensor
    """[1, T] int64, 0.. within each row (and within the tail)."""
    cu_seqlens: torch.Tensor
    """[docs + 1] int32: 0, each row's end, then T if a tail pads it."""
    row_starts: torch.Tensor
    """[b] int64 where each row begins in the packed row."""
    lengths: torch.Tensor
    """[b] int64 real tokens of each row."""
    prompt_lens: torch.Tensor
    """[b] int64 real prompt tokens of each row (>= 1)."""
    shifts: torch.Tensor
    """[b] int64 left padding each row had in the batch layout."""
    padding_mask: torch.Tensor
    """[1, T] bool, True where routers see padding: the tail and the rollout's
    uncaptured tokens (``router_padding_mask``)."""
    routes: torch.Tensor | None
    """[1, T, L, K] in the tokens' order, ``route_filler`` on the tail; None without
    routes."""
    width: int
    """S, the batch layout's width (where captured routes go back to)."""

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def max_seqlen(self) -> int:
        """The longest document (a varlen kernel's ``max_seqlen``)."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    def response_index(self, num_actions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, positions)`` broadcastable to ``[b, R]``: the logits predicting
        response token j of row b (``logits[rows, positions]``), clamped inside the row."""
        start = self.row_starts[:, None]
        target = start + self.prompt_lens[:, None] + torch.arange(num_actions)[None, :]
        target = torch.minimum(target, start + self.lengths[:, None] - 1)
        return torch.zeros_like(target), target - 1

    def to_batch_layout(self, routes: torch.Tensor) -> torch.Tensor:
        """Routes ``[1, T', L, K]`` captured on the packed row (``T' >= real tokens``),
        as ``[b, S, L, K]`` in the batch layout (CPU); every other position holds
        ``route_filler``."""
        rows = self.lengths.shape[0]
        captured = PackedRouteRows(
            values=routes.cpu()[0, : self.real_tokens],
            cu_seqlens=self.cu_seqlens[: rows + 1].to(torch.int64),
            starts=self.shifts,
            width=self.width,
        )
        return captured.rectangle()

    def padded_to(self, length: int, *, pad_token_id: int) -> PackedBatch:
        """This row with a tail up to ``length`` tokens, the tail one more document of
        pad tokens, all padding for the routers."""
        total = self.tokens.shape[1]
        extra = length - total
        if extra < 0:
            raise ValueError(f"length: expected at least the packed {total} tokens, got {length}")
        if extra == 0:
            return self
        routes = self.routes
        if routes is not None:
            filler = route_filler_tensor(routes).expand(1, extra, *routes.shape[2:])
            routes = torch.cat([routes, filler], dim=1)
        tail = torch.tensor([length], dtype=self.cu_seqlens.dtype)
        return dataclasses.replace(
            self,
            tokens=torch.cat([self.tokens, torch.full((1, extra), pad_token_id)], dim=1),
            positions=torch.cat([self.positions, torch.arange(extra)[None, :]], dim=1),
            cu_seqlens=torch.cat([self.cu_seqlens, tail]),
            padding_mask=torch.cat([self.padding_mask, torch.ones(1, extra, dtype=torch.bool)], 1),
            routes=routes,
        )

    def padded_to_multiple(self, multiple: int, *, pad_token_id: int) -> PackedBatch:
        """``padded_to`` the next multiple of ``multiple`` (sequence parallelism's)."""
        total = self.tokens.shape[1]
        return self.padded_to(total + (-total % multiple), pad_token_id=pad_token_id)


def pack_rows(batch: TrainingBatch, *, pad_token_id: int = 0) -> PackedBatch:
    """The microbatch ``batch``'s real tokens packed into one row, its routes with them;
    only the real tokens' routes are copied, never a rectangle of them."""
    shifts, prompt_lens = row_extents(batch)
    lengths = batch.attention_mask.to(torch.int64).sum(dim=1)
    rows, width = batch.sequences.shape
    row_starts = torch.cumsum(lengths, 0) - lengths
    flat = batch_positions(lengths, shifts, width)
    tokens = batch.sequences.reshape(-1)[flat].to(torch.int64)
    padding = torch.zeros(flat.shape[0], dtype=torch.bool)
    routes = None
    if isinstance(batch.routed_experts, PackedRouteRows):
        # The collated rows are already in this order: no copy of a rectangle.
        routes = aligned_route_rows(batch, shifts).values[None]
    elif batch.routed_experts is not None:
        trailing = batch.routed_experts.shape[2:]
        routes = batch.routed_experts.reshape(rows * width, *trailing)[flat][None]
    if batch.routed_experts is not None:
        if batch.router_padding_mask is not None:
            padding = batch.router_padding_mask.reshape(-1)[flat].to(torch.bool)
    cu = torch.zeros(rows + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return PackedBatch(
        tokens=tokens[None],
        positions=token_offsets(lengths)[None],
        cu_seqlens=cu,
        row_starts=row_starts,
        lengths=lengths,
        prompt_lens=prompt_lens,
        shifts=shifts,
        padding_mask=padding[None],
        routes=routes,
        width=width,
    )


def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each document of a packed row: ``query`` ``[T, h, d]``,
    ``key``/``value`` ``[T, g, d]`` (``h`` a multiple of ``g``, grouped-query heads
    repeated), ``cu_seqlens`` ``[docs + 1]`` covering all ``T``; returns ``[T, h * d]``.
    ``scale`` None: SDPA's own, 1/sqrt(d). Both backends' packed attention on the CPU
    (Megatron's ``PackedDotProductAttention``, FSDP's ``skyrl_packed_sdpa``)."""
    total, heads, _dim = query.shape
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if (
        bounds[0] != 0
        or bounds[-1] != total
        or any(a > b for a, b in zip(bounds, bounds[1:], strict=False))
    ):
        raise ValueError(
            f"cu_seqlens: expected 0 .. {total} non-decreasing (the packed row's tokens), "
            f"got {bounds[:4]}{' ...' if len(bounds) > 4 else ''} ending {bounds[-1]}"
        )
    repeat = heads // key.shape[1]
    if repeat > 1:
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    parts = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        if end == start:
            continue
        # [n, h, d] -> [h, n, d]: one document's heads as SDPA's batch.
        out = torch.nn.functional.scaled_dot_product_attention(
            query[start:end].transpose(0, 1),
            key[start:end].transpose(0, 1),
            value[start:end].transpose(0, 1),
            is_causal=True,
            scale=scale,
            dropout_p=dropout,
        )
        parts.append(out.transpose(0, 1).reshape(end - start, -1))
    return torch.cat(parts)
