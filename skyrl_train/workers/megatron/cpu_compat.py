"""The one place where megatron-core is taught to run without CUDA.

megatron-core 0.16.1 builds and trains a tiny MoE ``GPTModel`` on CPU (gloo, world
size 1 and 2 with EP=2), and runs its pipeline schedules (no pipelining, 1F1B and
interleaved, PP=2 over gloo), once these CUDA assumptions are redirected:

- ``torch.cuda.current_device()`` is used as a ``device=`` argument for buffers
  (router token counters, for example); on CPU it must name ``"cpu"``.
- The RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork``)
  saves and restores the CUDA generator; here the CPU generator stands in for it.
- ``tensor_parallel.random._get/_set_cuda_rng_state`` go through ``torch.cuda``
  lazy-init internals; they are mapped to the CPU generator as well.
- ``moe_utils.te_general_gemm`` is only defined when Transformer Engine imports, yet
  the router's gating function reads it unconditionally (a NameError otherwise).

- The schedules (``pipeline_parallel/schedules.py``) create their token counter with
  a literal ``device="cuda"``; that module alone sees a ``torch`` whose ``zeros``
  puts such tensors on the CPU (a TorchFunctionMode would do the same for every op of
  every forward, in Python).
- The point-to-point layer calls ``torch.cuda.synchronize()`` after batched
  send/recv (a guard against a NCCL race); gloo's requests are complete once waited.
- The alltoall token dispatcher creates a ``torch.cuda.Stream`` when built and, on
  it, copies its split sizes to host numpy arrays (``all_to_all_single`` takes a
  sequence, not a tensor); on CPU its stream is a placeholder and the sizes, host
  tensors already, become the same numpy arrays without a stream.

``apply_cpu_compat()`` is a no-op when CUDA is available and idempotent otherwise.
Megatron's distributed optimizer still hard-codes CUDA; the worker steps
``torch.optim.AdamW`` itself.
"""

from __future__ import annotations

import types
from typing import Any

import torch

_APPLIED = False


def _cpu_get_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.random.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.random.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which must stay
    # the stock lazy no-op (patching it too recursed).
    torch.default_generator.manual_seed(int(seed))


def _cpu_current_device() -> str:
    return "cpu"


def _no_synchronize(*_args: Any, **_kwargs: Any) -> None:
    return None


def _splits_to_numpy(
    self: Any, _point: str, tokens_per_expert: torch.Tensor | None = None
) -> torch.Tensor | None:
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        splits = getattr(self, name, None)
        if torch.is_tensor(splits):
            setattr(self, name, splits.numpy())
    return tokens_per_expert


class _TorchOnCpu(types.ModuleType):
    """``torch`` as the schedules module sees it: ``zeros(..., device="cuda")`` lands
    on the CPU; every other name is torch's own object."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def cpu_compat_needed() -> bool:
    """True when the shim applies: no usable CUDA device in this process."""
    return not torch.cuda.is_available()


def apply_cpu_compat() -> bool:
    """Patch torch.cuda / megatron for CPU; returns True when the shim is (now) active."""
    global _APPLIED
    if not cpu_compat_needed():
        return False
    if _APPLIED:
        return True
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.cuda.get_rng_state = _cpu_get_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = _cpu_set_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = _cpu_manual_seed  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = _cpu_get_rng_state  # type: ignore[assignment]
    torch.cuda.random.set_rng_state = _cpu_set_rng_state  # type: ignore[assignment]
    torch.cuda.synchronize = _no_synchronize  # type: ignore[assignment]
    schedules.torch = _TorchOnCpu()  # type: ignore[attr-defined]
    tp_random._get_cuda_rng_state = _cpu_get_rng_state
    tp_random._set_cuda_rng_state = _cpu_set_rng_state
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _splits_to_numpy  # type: ignore[method-assign]
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _APPLIED = True
    return True
