"""Build the FSDP backend's model: transformers' own class from a checkpoint folder,
sharded with FSDP2's ``fully_shard`` per decoder layer over every trainer rank.

The model comes from the checkpoint's ``config.json`` (``AutoModelForCausalLM.from_config``,
fp32, seeded); its weights arrive later through the worker's ``load_weights``, as the
trainer loads every backend (``trainer/policy.py``). The names of its
``named_parameters`` are the engine's HF layout, so weights need no conversion.

The model is sharded over a 1-D mesh of all the process group's ranks (data parallel
only). A process without a group joins a world of one on an in-process store first,
as the Megatron worker does (``utils/distributed.py``), so one rank runs the same code
path, mixed precision included. Device-agnostic: CUDA with NCCL when available, else
CPU with gloo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from skyrl_train.config.schema import FSDPConfig

FSDP_CONFIG_KEY = "trainer.policy.fsdp_config"
"""Where the worker's ``FSDPConfig`` sits in the config; messages name it."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def device_type() -> str:
    """``"cuda"`` when this process has a GPU, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_hf_model(checkpoint: str | Path, *, seed: int, attn_implementation: str = "eager") -> Any:
    """transformers' model for the checkpoint's config, fp32, its random init drawn
    under ``seed`` (the caller's RNG state kept), attention by ``attn_implementation``
    (``FSDPConfig.attn_implementation``); weights are loaded afterwards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint), local_files_only=True)
    config.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    return model


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's decoder layers (``model.model.layers`` in every family here)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"checkpoint: expected a decoder-only model with model.layers, got "
            f"{type(model).__name__}"
        )
    return list(layers)


def shard_model(model: Any, config: FSDPConfig) -> Any:
    """Activation checkpointing per decoder layer when the config asks, then
    ``fully_shard`` on each decoder layer and the root over all ranks (joining a world
    of one first when this process has no group). Returns the 1-D device mesh."""
    if config.activation_checkpointing:
        # transformers' own per-layer checkpointing, non-reentrant: the recompute runs
        # FSDP2's and the gates' hooks again, inside the microbatch's replay session.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not torch.distributed.is_initialized():
        from skyrl_train.utils.distributed import init_distributed

        init_distributed(rank=0, world_size=1, init_method="env://")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type(), (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=_DTYPES[config.param_dtype], reduce_dtype=_DTYPES[config.reduce_dtype]
    )
    for layer in decoder_layers(model):
        fully_shard(
            layer,
            mesh=mesh,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=policy,
        )
    fully_shard(
        model, mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=policy
    )
    return mesh
