"""Megatron's parallel groups for one layout: torch.distributed joined (gloo on CPU,
nccl with CUDA, the CPU shim applied first), megatron-core's tensor, pipeline, expert
and data-parallel groups built for a ``MegatronConfig``, and torn down, their process
groups with them, when a worker of another layout is built in the same process.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from skyrl_train.config.schema import MegatronConfig
from skyrl_train.utils.distributed import init_distributed as join_process_group
from skyrl_train.workers.megatron.cpu_compat import apply_cpu_compat


def init_distributed(*, rank: int, world_size: int, init_method: str) -> None:
    """Apply the CPU shim, then join torch.distributed's default group
    (``utils.distributed.init_distributed``: gloo on CPU, nccl with CUDA)."""
    apply_cpu_compat()
    join_process_group(rank=rank, world_size=world_size, init_method=init_method)


def destroy_parallel_state() -> None:
    """Megatron's parallel state torn down, its process groups with it.

    ``destroy_model_parallel`` only drops megatron-core's references: torch keeps every
    group registered, so each re-initialisation in one process left its gloo groups'
    threads running (a test building 20 layouts on 8 ranks reached ~900 threads a rank
    and a load average over 1,000 on 2 cores). Destroying a subgroup is local to the rank.
    """
    from megatron.core import parallel_state

    found: dict[int, Any] = {}
    for name, value in vars(parallel_state).items():
        if "GROUP" in name:  # a group, or a list or dict of groups
            items = value.values() if isinstance(value, dict) else value
            many = isinstance(items, (list, tuple)) or isinstance(value, dict)
            for group in items if many else [value]:
                if isinstance(group, torch.distributed.ProcessGroup):
                    found[id(group)] = group
    parallel_state.destroy_model_parallel()
    world = torch.distributed.GroupMember.WORLD
    for group in found.values():
        if group is world:
            continue
        with contextlib.suppress(ValueError):  # not registered (already destroyed)
            torch.distributed.destroy_process_group(group)


def init_parallel_state(mc: MegatronConfig, *, seed: int) -> None:
    """Initialise torch.distributed (gloo on CPU) and Megatron's parallel groups of ``mc``.

    A process with no process group yet gets a world of one on an in-process store;
    with WORLD_SIZE > 1 it joins via env:// (MASTER_ADDR/MASTER_PORT/RANK), or the
    caller initialises torch.distributed itself first. Re-initialising
    with the same sizes is a no-op, so several workers can be built in one test process.
    """
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_compat()
    if not torch.distributed.is_initialized():
        init_distributed(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            init_method="env://",
        )
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == mc.tensor_model_parallel_size
            and parallel_state.get_pipeline_model_parallel_world_size()
            == mc.pipeline_model_parallel_size
            and parallel_state.get_expert_model_parallel_world_size()
            == mc.expert_model_parallel_size
            and parallel_state.get_expert_tensor_parallel_world_size()
            == (mc.expert_tensor_parallel_size or mc.tensor_model_parallel_size)
            and parallel_state.get_virtual_pipeline_model_parallel_world_size()
            == mc.virtual_pipeline_model_parallel_size
        )
        if not same:
            destroy_parallel_state()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=mc.tensor_model_parallel_size,
            pipeline_model_parallel_size=mc.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=mc.virtual_pipeline_model_parallel_size,
            context_parallel_size=mc.context_parallel_size,
            expert_model_parallel_size=mc.expert_model_parallel_size,
            # The groups the expert weights are sharded and dispatched over; left out,
            # megatron-core builds them at ETP = TP whatever the TransformerConfig says.
            expert_tensor_parallel_size=mc.expert_tensor_parallel_size,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
