"""What the policy worker needs from its pipeline-parallel group.

Under a pipeline schedule only the last stage computes logits, so log-probs, entropy
and losses exist there; each stage's routers see only that stage's layers; and the
interleaved schedule needs a microbatch count it can group (Megatron raises for 3
microbatches at PP=2). These helpers move the results to every rank of the group, so
the trainer code above the worker reads the same values on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PipelineGroup:
    size: int
    """Pipeline stages (1: no pipelining, and every helper is the identity)."""
    rank: int
    virtual_stages: int | None
    group: Any = None
    last_rank: int = 0
    """Global rank of the last stage in this rank's pipeline group."""

    @classmethod
    def current(cls) -> PipelineGroup:
        """This rank's group, from Megatron's initialised parallel state."""
        from megatron.core import parallel_state

        size = parallel_state.get_pipeline_model_parallel_world_size()
        if size == 1:
            return cls(size=1, rank=0, virtual_stages=None)
        group = parallel_state.get_pipeline_model_parallel_group()
        return cls(
            size=size,
            rank=parallel_state.get_pipeline_model_parallel_rank(),
            virtual_stages=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            group=group,
            last_rank=torch.distributed.get_global_rank(group, size - 1),
        )

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def padded_count(self, count: int) -> int:
        """Microbatches the schedule runs for ``count`` real ones: with virtual stages
        Megatron groups microbatches ``size`` at a time and refuses a partial group
        (``microbatch_group_size_per_vp_stage`` defaults to the pipeline size)."""
        if not self.virtual_stages:
            return count
        return -(-count // self.size) * self.size

    def from_last_stage(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as the last stage holds them, on every stage."""
        if self.size == 1:
            return values
        values = values.contiguous()
        torch.distributed.broadcast(values, src=self.last_rank, group=self.group)
        return values

    def tensors_from_last_stage(
        self, tensors: Sequence[torch.Tensor | None], shapes: Sequence[tuple[int, ...]]
    ) -> list[torch.Tensor]:
        """Per-microbatch fp32 tensors of ``shapes`` (None on the other stages), as the
        last stage holds them, on every stage."""
        if self.size == 1:
            missing = [i for i, t in enumerate(tensors) if t is None]
            if missing:
                raise RuntimeError(f"microbatch {missing[0]}: expected a result, got none")
            return [t for t in tensors if t is not None]
        out = []
        for tensor, shape in zip(tensors, shapes, strict=True):
            if self.is_last:
                if tensor is None:
                    raise RuntimeError("last pipeline stage: expected a result, got none")
                buffer = tensor.to(torch.float32).contiguous()
            else:
                buffer = torch.empty(shape, dtype=torch.float32)
            torch.distributed.broadcast(buffer, src=self.last_rank, group=self.group)
            out.append(buffer)
        return out

    def sum_over_stages(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over the group: each stage fills disjoint parts and zeros elsewhere."""
        if self.size == 1:
            return values
        values = values.contiguous()
        torch.distributed.all_reduce(values, group=self.group)
        return values
