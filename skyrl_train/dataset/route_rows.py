"""A batch's rollout routes packed by row: ``[T, L, K]`` and where each row sits.

What ``convert_to_training_batch`` puts in ``TrainingBatch.routed_experts``: trajectory
b's routes for its tokens 0..n_b-1 (prompt then response, ``n_b`` its real tokens), one
row after another, ``T = sum n_b``. The padded ``[B, S, L, K]`` rectangle is never
built on the way to the ranks: on a ragged batch about half of it was padding
(docs/r3-and-pipeline.md, "Packed batches"), at ``L * K`` times the tokens' bytes. A
backend that needs a rectangle builds one microbatch's (``rectangle``), and the packed
trainer path takes the rows' values as they are (``workers/packed_layout.py``).

``PackedRouteRows`` behaves as a row tensor where the batch code needs one: rows are
selected with ``[slice]`` (a view, no copy) or ``[index tensor]`` (the driver's
data-parallel reorder), and ``to(device)`` moves it, so ``dataset.batch.map_tensors``
carries it like every other per-row field. Importing this module loads no backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference.wire import route_filler

__all__ = [
    "PackedRouteRows",
    "RouteTensor",
    "batch_positions",
    "route_filler_tensor",
    "token_offsets",
]


def route_filler_tensor(routes: torch.Tensor) -> torch.Tensor:
    """``route_filler`` for ``[..., K]`` routes, in their dtype: the fill of their padding rows."""
    return torch.from_numpy(route_filler(routes.shape[-1], np.int64)).to(routes.dtype)


def token_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[sum lengths]`` each token's index within its row, rows packed one after another."""
    firsts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(firsts, lengths)


def batch_positions(lengths: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """``[sum lengths]`` each packed token's place in the flattened ``[B * width]`` batch
    layout, row b's tokens from column ``starts[b]``."""
    rows = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    return rows * width + starts[rows] + token_offsets(lengths)


@dataclass(frozen=True)
class PackedRouteRows:
    """B rows of routes packed one after another (this module's docstring)."""

    values: torch.Tensor
    """[T, L, K] integer expert ids; a row's uncaptured tokens hold ``route_filler`` and
    are True in the batch's ``router_padding_mask``."""
    cu_seqlens: torch.Tensor
    """[B + 1] int64: row b's tokens are ``values[cu_seqlens[b]:cu_seqlens[b + 1]]``."""
    starts: torch.Tensor
    """[B] int64: the batch-layout column of each row's token 0 (its left padding)."""
    width: int
    """S, the batch layout's width."""

    def __post_init__(self) -> None:
        if self.values.dim() != 3:
            raise ValueError(
                f"routed_experts.values: expected [T, L, K], got shape {tuple(self.values.shape)}"
            )
        rows = self.starts.shape[0]
        if self.cu_seqlens.shape != (rows + 1,):
            raise ValueError(
                f"routed_experts.cu_seqlens: expected {rows + 1} offsets (one per row and "
                f"the end), got shape {tuple(self.cu_seqlens.shape)}"
            )
        if int(self.cu_seqlens[-1]) - int(self.cu_seqlens[0]) != self.values.shape[0]:
            raise ValueError(
                f"routed_experts.cu_seqlens: expected to span the {self.values.shape[0]} "
                f"packed tokens, got {self.cu_seqlens.tolist()[:4]}..."
            )

    @classmethod
    def from_rectangle(cls, routes: torch.Tensor, attention_mask: torch.Tensor) -> PackedRouteRows:
        """The real tokens' routes of a ``[B, S, L, K]`` rectangle (``attention_mask``
        ``[B, S]``: each row's real tokens, one block after its left padding)."""
        real = attention_mask.to(torch.bool)
        lengths = real.sum(dim=1).to(torch.int64)
        cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        starts = real.to(torch.int8).argmax(dim=1).to(torch.int64)
        return cls(values=routes[real], cu_seqlens=cu, starts=starts, width=routes.shape[1])

    # ---- what a row tensor answers -------------------------------------------------

    @property
    def num_rows(self) -> int:
        return int(self.starts.shape[0])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``[B, S, L, K]``: the rectangle these routes stand for."""
        layers, top_k = self.values.shape[1:]
        return (self.num_rows, self.width, int(layers), int(top_k))

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64 tokens of each row."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def to(self, device: torch.device | str) -> PackedRouteRows:
        return PackedRouteRows(
            values=self.values.to(device),
            cu_seqlens=self.cu_seqlens,
            starts=self.starts,
            width=self.width,
        )

    def __getitem__(self, rows: slice | torch.Tensor) -> PackedRouteRows:
        """Rows ``rows`` (a slice: a view of their values; an index tensor: a copy)."""
        if isinstance(rows, slice):
            start, stop, step = rows.indices(self.num_rows)
            if step == 1:
                stop = max(start, stop)
                lo, hi = int(self.cu_seqlens[start]), int(self.cu_seqlens[stop])
                return PackedRouteRows(
                    values=self.values[lo:hi],
                    cu_seqlens=self.cu_seqlens[start : stop + 1] - lo,
                    starts=self.starts[start:stop],
                    width=self.width,
                )
            rows = torch.arange(start, stop, step)
        index = torch.as_tensor(rows, dtype=torch.int64)
        lengths = self.lengths[index]
        cu = torch.zeros(index.shape[0] + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        return PackedRouteRows(
            values=self.values[self._token_index(index)],
            cu_seqlens=cu,
            starts=self.starts[index],
            width=self.width,
        )

    # ---- layouts --------------------------------------------------------------------

    def batch_index(self, *, contiguous: bool = False) -> torch.Tensor:
        """``[T]`` each packed token's place in the flattened ``[B * S]`` batch layout
        (``contiguous``: in the layout with each row moved to column 0)."""
        starts = torch.zeros_like(self.starts) if contiguous else self.starts
        return batch_positions(self.lengths, starts, self.width)

    def rectangle(self, *, contiguous: bool = False) -> torch.Tensor:
        """``[B, S, L, K]`` with ``route_filler`` off the rows' tokens: one microbatch's,
        for a backend that runs padded rows (``contiguous``: rows from column 0)."""
        rows, width, layers, top_k = self.shape
        filler = route_filler_tensor(self.values).to(self.device)
        out = filler.expand(rows * width, layers, top_k).clone()
        out[self.batch_index(contiguous=contiguous).to(self.device)] = self.values
        return out.view(rows, width, layers, top_k)

    def _token_index(self, rows: torch.Tensor) -> torch.Tensor:
        lengths = self.lengths[rows]
        first = self.cu_seqlens[:-1][rows] - self.cu_seqlens[0]
        return torch.repeat_interleave(first, lengths) + token_offsets(lengths)


RouteTensor = torch.Tensor | PackedRouteRows
"""``TrainingBatch.routed_experts``: a ``[B, S, L, K]`` tensor (a batch built by hand, or
R2's captured routes) or the collated ``PackedRouteRows``."""
