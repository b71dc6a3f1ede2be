"""Resharding checks run on two gloo ranks (inside ``test_megatron_pipeline.py``'s
interleaved launch, whose process group they reuse): a checkpoint saved under one layout
after one AdamW step is restored under another through ``runs/reshard.py``, the code the
trainer runs (``PolicyTrainer.load_checkpoint``).

Every layout gets the same whole batch on both ranks, so data-parallel replicas (TP=1 and
EP=2 on two ranks are DP=2) take the one-rank step and every layout is comparable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _megatron_batches import PAD_ID

from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.runs.rank_file import checkpoint_file, save_rank_state
from skyrl_train.runs.resume import rank_checkpoint, restore_rank
from skyrl_train.workers.megatron.placement import parallel_layout

WORLD = 2
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp1": {},
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2xvpp2": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
    "ep2": {"expert_model_parallel_size": 2},
}
PAIRS = (
    ("tp1", "tp2"),
    ("tp1", "pp2xvpp2"),
    ("tp1", "ep2"),
    ("tp2", "tp1"),
    ("pp2xvpp2", "tp1"),
    ("ep2", "tp2"),
)
"""(saved under, resumed under): TP=1 to every other layout, back to TP=1, and each
rank's half of the experts (EP=2) to both TP ranks' halves of every expert."""


def _layout(name: str) -> dict[str, Any]:
    """The layout record ``PolicyTrainer.save_checkpoint`` writes for a layout."""
    return parallel_layout(MegatronConfig(**LAYOUTS[name]), world=WORLD).record()


def _worker(cfg: TinyMoEConfig, name: str) -> Any:
    from skyrl_train.workers.megatron import MegatronPolicyWorker

    return MegatronPolicyWorker(
        cfg.architecture(),
        MegatronConfig(moe_enable_routing_replay=True, **LAYOUTS[name]),
        optimizer=OptimizerConfig(lr=1e-2, max_grad_norm=1.0),
        pad_token_id=PAD_ID,
    ).setup()


def _hf_state(worker: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The weights and both AdamW moments under HF names, whole: the moments exported
    as if they were the weights, so every layout's shards are gathered the same way."""
    out = {"weights": dict(worker.export_weights())}
    state = worker.optimizer.state
    params = dict(worker.model.named_parameters())
    for moment in ("exp_avg", "exp_avg_sq"):
        with worker.swapped_weights({n: state[p][moment] for n, p in params.items()}):
            out[moment] = dict(worker.export_weights())
    out["step"] = {"all": torch.tensor(sorted({float(s["step"]) for s in state.values()}))}
    return out


def reshard_checks(
    rank: int, out: Path, *, cfg: TinyMoEConfig, batch: Any, loss_fn: Any, micro: int
) -> dict[str, Any]:
    """Per source layout: its state after one step and the next step's loss and grad
    norm; per pair: the restored state and the next step under the new layout."""
    hf_state = build_hf_model(cfg, seed=1).state_dict()
    sources: dict[str, Any] = {}
    for name in sorted({src for src, _dst in PAIRS}):
        worker = _worker(cfg, name)
        worker.load_weights(hf_state.items())
        worker.train_step(batch, loss_fn=loss_fn, micro_batch_size=micro)
        folder = out / f"reshard_{name}"
        folder.mkdir(exist_ok=True)
        state = rank_checkpoint(worker, world_size=WORLD, layout=_layout(name))
        save_rank_state(checkpoint_file(folder, rank), state)
        got = _hf_state(worker)
        step = worker.train_step(batch, loss_fn=loss_fn, micro_batch_size=micro)
        sources[name] = {**got, "loss": step.loss, "grad_norm": step.grad_norm}
    torch.distributed.barrier()  # every rank file is written before any is read
    resumed: dict[str, Any] = {}
    for src, dst in PAIRS:
        worker = _worker(cfg, dst)
        # The checkpoint's weights only through the reshard: these are another seed's.
        worker.load_weights(build_hf_model(cfg, seed=2).state_dict().items())
        done = restore_rank(
            out / f"reshard_{src}", worker, rank=rank, world_size=WORLD, layout=_layout(dst)
        )
        assert done is not None, (src, dst, "restored as the same layout")
        got = _hf_state(worker)
        step = worker.train_step(batch, loss_fn=loss_fn, micro_batch_size=micro)
        resumed[f"{src}->{dst}"] = {
            **got,
            "loss": step.loss,
            "grad_norm": step.grad_norm,
            "moments": done.moments,
            "parameters": done.parameters,
        }
    return {"sources": sources, "resumed": resumed}
