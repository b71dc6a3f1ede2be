"""Forwards that drop no tokens over an expert's capacity, whatever the run configured.

``moe_expert_capacity_factor`` (a ``transformer_config_kwargs`` passthrough, allowed
with replay off) makes Megatron's router drop a token's assignment to an expert past
that expert's capacity: a training-time choice, which no inference engine makes. The
served-weights probe compares the trainer's logprobs with the engine's, so it must be
scored the way the engine computes: at factor 1.0 the dropping alone put the tiny
model's median |served - trainer| at 1.04, ten times the check's bound, with the
weights right (issue 49).

The router reads the factor from its ``TransformerConfig`` at every forward
(``TopKRouter.routing``); the alltoall dispatcher also keeps ``drop_and_pad`` from
``moe_pad_expert_input_to_capacity``, read once at build. Both are switched off for the
block and restored on exit, an exception included.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

_CONFIG_FIELDS = {"moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False}
"""What each field is set to inside the block: no capacity, no padding to one."""


@contextmanager
def token_dropping(chunks: Sequence[torch.nn.Module], *, enabled: bool) -> Iterator[None]:
    """Run the block with the model's capacity factor as configured (``enabled``) or
    with none (no token dropped, the engines' computation)."""
    if enabled:
        yield
        return
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, name, value in _capacity_settings(chunks):
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _capacity_settings(chunks: Sequence[torch.nn.Module]) -> Iterator[tuple[Any, str, Any]]:
    """``(object, attribute, value without dropping)`` for every distinct config and
    dispatcher of ``chunks`` that holds a capacity setting."""
    seen: set[int] = set()
    for chunk in chunks:
        for module in chunk.modules():
            for owner in (
                getattr(module, "config", None),
                getattr(module, "token_dispatcher", None),
            ):
                if owner is None or id(owner) in seen:
                    continue
                seen.add(id(owner))
                for name, value in _CONFIG_FIELDS.items():
                    if hasattr(owner, name):
                        yield owner, name, value
                if getattr(owner, "drop_and_pad", False):
                    yield owner, "drop_and_pad", False
