"""What engine a server process builds: a small picklable record, built where it runs.

The Ray actor and ``python -m inference.server`` both take an ``EngineSpec`` rather
than an engine, so the model is built inside the serving process (a model does not
cross a process boundary cheaply, and its worker thread cannot at all).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from inference.engine.base import InferenceEngine


@dataclass(frozen=True)
class EngineSpec:
    """A CPU MoE engine, normally from a ``checkpoint`` folder.

    ``checkpoint`` is any folder ``inspect_checkpoint`` accepts: a Qwen3-MoE, Qwen2-MoE,
    OLMoE or Mixtral checkpoint (``scripts/make_checkpoint.py`` writes tiny ones), whose
    config, EOS and pad ids the engine uses. Without one the engine is the built-in
    Qwen3-MoE randomly initialised from ``tiny_moe`` (``TinyMoEConfig`` overrides) and
    ``seed``, in milliseconds and without a folder, for the server tests and
    ``python -m inference.server`` without ``--checkpoint``. (The trainer's launch
    always passes a folder: the built-in model is written as one first.)
    """

    tiny_moe: dict[str, Any] = field(default_factory=dict)
    """``TinyMoEConfig`` overrides for the random-init engine; must be empty with a
    checkpoint (the checkpoint has its own config)."""
    checkpoint: str | None = None
    seed: int = 0
    """Random-init weights only; a checkpoint's weights are its own."""
    dtype: str = "bfloat16"
    """Inference engines run in bf16; "float32" gives exact comparisons in tests."""
    model_name: str = "tiny-moe"
    max_batch_size: int = 64
    batch_window_ms: float = 5.0
    batch_invariant: bool = True
    """A request's output depends on its prompt and seed only, not on the requests the
    batching window puts next to it (``inference.models.batch_invariant``); off is the
    stock forward, faster at large batches (see scripts/bench_batch_invariance.py)."""

    def __post_init__(self) -> None:
        if self.checkpoint is not None and self.tiny_moe:
            raise ValueError(
                "EngineSpec.tiny_moe: expected {} with a checkpoint (the checkpoint has its "
                f"own config), got {self.tiny_moe!r}"
            )

    def build(self) -> InferenceEngine:
        from inference.engine.hf_engine import HFMoEEngine
        from inference.models.tiny_moe import TinyMoEConfig

        options: dict[str, Any] = {
            "model_name": self.model_name,
            "max_batch_size": self.max_batch_size,
            "batch_window_ms": self.batch_window_ms,
            "batch_invariant": self.batch_invariant,
        }
        if self.checkpoint is not None:
            return HFMoEEngine.from_pretrained(self.checkpoint, dtype=self.dtype, **options)
        config = TinyMoEConfig.from_dict(self.tiny_moe)
        return HFMoEEngine.from_config(config, seed=self.seed, dtype=self.dtype, **options)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
