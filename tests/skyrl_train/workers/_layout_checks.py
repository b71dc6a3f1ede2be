"""One Megatron layout against the single-rank reference: the batch, the run and the
comparison every multi-rank layout test shares (``test_megatron_tensor_parallel.py`` on
2 ranks, ``test_megatron_layout_grid.py`` on 8).

``run_case`` builds the worker for a layout, loads a checkpoint and runs, on the same
batch: an R3 forward (routes replayed), an R2 source forward (no replay: the trainer's
own routes), the R3 train step (a kept-set sampler at temperature 0.7, an entropy bonus
and a KL term, gradients clipped at 1.0), the R2 train step from the checkpoint's
weights, and a forward with this rank's route shard swapped for another rank's.
``compare`` holds the layout to the reference: log-probs and entropy within 1e-5, loss
and gradient norm within 1e-5 relative, the clipped gradients element by element, the
weights after one step within 1e-5 where the gradient is at least 1e-6, agreement 1.0,
and the swapped shard below 0.5 agreement.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from _megatron_batches import PAD_ID, make_batch, random_routes
from _step_checks import clipped_grads, steady, steady_worst

from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.dataset.route_rows import PackedRouteRows
from skyrl_train.workers.microbatches import MicrobatchPlan

PROMPTS = [[72, 105, 33], [1, 2, 3, 4, 5], [40, 41], [9, 8, 7, 6]]
RESPONSES = [[50, 51, 52, 53], [60, 61, 62], [70, 71, 72, 73], [80, 81]]
# The Target of issue 39 (docs/parallel-layouts.md).
TOL = 1e-5


def batch(routes: torch.Tensor) -> Any:
    per_row = [routes[b, : len(PROMPTS[b]) + len(RESPONSES[b]) - 1] for b in range(4)]
    layers, top_k = routes.shape[2], routes.shape[3]
    out = make_batch(PROMPTS, RESPONSES, num_layers=layers, top_k=top_k, routes=per_row)
    # Kept sets across both vocabulary shards (264 ids: [0, 132) and [132, 264)), the
    # sampled token among them; a row of -1 keeps the whole vocabulary.
    support = torch.full((4, out.num_actions, 5), -1, dtype=torch.int64)
    for b, response in enumerate(RESPONSES):
        for j, token in enumerate(response[:-1]):
            support[b, j] = torch.tensor([token, 140, 7, 200 + j, 263])
    return dataclasses.replace(out, sample_support=support)


def agreement(got: torch.Tensor, want: Any, batch: Any) -> float:
    if isinstance(want, PackedRouteRows):
        want = want.rectangle()
    real = ~batch.router_padding_mask
    same = (got.sort(-1).values == want.sort(-1).values).all(-1)[real]
    return float(same.float().mean())


def _loss(lp: torch.Tensor, mb: Any, ent: torch.Tensor) -> torch.Tensor:
    # A policy-gradient term, an entropy bonus and k3 KL to the first forward's
    # logprobs (stored as rollout_logprobs), as the trainer's loss combines them.
    mask = mb.response_mask.to(lp.dtype)
    ref = mb.rollout_logprobs
    kl = ((ref - lp).exp() - (ref - lp) - 1) * mask
    return (-(lp * mask).sum() - 0.01 * (ent * mask).sum() + 0.1 * kl.sum()) / mask.sum()


def _worker(
    arch: Any, layout: dict[str, Any], *, packed: bool = False
) -> tuple[MegatronConfig, Any]:
    """A Megatron worker of ``layout`` with R3 on, as every case and resume builds it;
    ``packed``: ``trainer.remove_microbatch_padding``."""
    from skyrl_train.workers.megatron import MegatronPolicyWorker

    mc = MegatronConfig(moe_enable_routing_replay=True, **layout)
    worker = MegatronPolicyWorker(
        arch,
        mc,
        optimizer=OptimizerConfig(lr=1e-2, max_grad_norm=1.0),
        pad_token_id=PAD_ID,
        temperature=0.7,
        remove_microbatch_padding=packed,
    ).setup()
    return mc, worker


REORDERED = MicrobatchPlan(((1, 3), (0, 2)))
"""Rows out of batch order: a packed forward's results and routes must come back in it."""


def run_case(
    arch: Any,
    layout: dict[str, Any],
    hf_state: dict[str, torch.Tensor],
    *,
    r3_only: bool = False,
    packed: bool = False,
) -> dict[str, Any]:
    """``r3_only``: the R3 forward and train step alone (no R2 step, no swapped shard).
    ``packed``: each microbatch packed into one row (``remove_microbatch_padding``), the
    forward's microbatches ``REORDERED`` (the train step's are the reference's: the test
    loss is a mean per microbatch)."""
    mc, worker = _worker(arch, layout, packed=packed)
    check_expert_shards(worker, arch, mc)
    core = worker.chunks[0].decoder.layers[0].self_attention.core_attention
    out: dict[str, Any] = {"attention": type(core).__name__}
    worker.load_weights(hf_state.items())
    tp = mc.tensor_model_parallel_size
    layers, experts, top_k = len(arch.moe_layers), arch.num_experts, arch.num_experts_per_tok
    rollout = batch(random_routes(4, 9, layers, experts, top_k, seed=11))
    embedding = getattr(worker.chunks[0], "embedding", None)  # first pipeline stage only
    rows = embedding.word_embeddings.weight.shape[0] * tp if embedding is not None else None
    if rows is not None and rows != arch.vocab_size:
        # A padded model serves and exports the checkpoint's rows, exactly as loaded.
        out["rows"] = rows
        exported = dict(worker.export_weights())
        assert exported.keys() == hf_state.keys()
        assert all(torch.equal(exported[n], hf_state[n]) for n in hf_state)
        # A checkpoint tensor of the padded size is not the checkpoint's: refused by name.
        embed = "model.embed_tokens.weight"
        wide = torch.ones(rows, arch.hidden_size)
        with pytest.raises(ValueError, match=rf"^{embed}.shape: expected \({arch.vocab_size}, "):
            worker.load_weights([(embed, wide)])
        assert torch.equal(dict(worker.export_weights())[embed], hf_state[embed])
    plan = REORDERED if packed else None
    if packed:  # the routes as collation hands them over: packed by row
        rows = PackedRouteRows.from_rectangle(rollout.routed_experts, rollout.attention_mask)
        rollout = dataclasses.replace(rollout, routed_experts=rows)
    first = worker.forward(rollout, capture_routes=True, entropy=True, micro_batch_size=plan)
    out["logprobs"], out["entropy"] = first.logprobs, first.entropy
    out["r3_forward"] = agreement(first.routes, rollout.routed_experts, rollout)
    rollout = dataclasses.replace(rollout, rollout_logprobs=first.logprobs)
    if not r3_only:
        # R2's source: what the trainer's routers choose themselves (no replay).
        own = worker.forward(dataclasses.replace(rollout, routed_experts=None), capture_routes=True)
        out["own_routes"] = own.routes
    step = worker.train_step(
        rollout, loss_fn=_loss, micro_batch_size=2, entropy=True, capture_routes=True
    )
    out["r3_step"] = agreement(step.routes, rollout.routed_experts, rollout)
    out["loss"], out["grad_norm"] = step.loss, step.grad_norm
    out["weights"] = dict(worker.export_weights())
    out["grads"] = clipped_grads(worker)
    if r3_only:
        return out
    r2 = dataclasses.replace(rollout, routed_experts=own.routes)
    # Back to the checkpoint's weights, so the R2 step's loss and norm compare on the
    # same weights: after step 1 the layouts differ where AdamW's first step amplified
    # rounding (_step_checks.steady), and that would reach every later loss.
    worker.load_weights(hf_state.items())
    step2 = worker.train_step(
        r2, loss_fn=_loss, micro_batch_size=2, entropy=True, capture_routes=True
    )
    out["r2_step"] = agreement(step2.routes, own.routes, r2)
    out["loss2"], out["grad_norm2"] = step2.loss, step2.grad_norm
    out["swapped"] = _wrong_shard_agreement(worker, rollout)
    out["worker"], out["rollout"] = worker, rollout
    return out


def resume_elsewhere(
    got: dict[str, Any],
    arch: Any,
    *,
    source: dict[str, Any],
    target: dict[str, Any],
    folder: Path,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """Save ``run_case``'s worker (``got``, laid out as ``source``) as the trainer does and
    resume it laid out as ``target`` through ``runs/reshard.py``: the whole weights and
    AdamW moments on both sides, and each side's forward and next train step."""
    from _reshard_checks import _hf_state

    from skyrl_train.runs.rank_file import checkpoint_file, save_rank_state
    from skyrl_train.runs.resume import rank_checkpoint, restore_rank
    from skyrl_train.workers.megatron.placement import parallel_layout

    saved, rollout = got["worker"], got["rollout"]
    layout = parallel_layout(MegatronConfig(**source), world=world).record()
    save_rank_state(
        checkpoint_file(folder, rank), rank_checkpoint(saved, world_size=world, layout=layout)
    )
    want = _hf_state(saved)
    sides = {"want": want, "want_next": _next(saved, rollout)}
    torch.distributed.barrier()  # every rank file is written before any is read
    mc, worker = _worker(arch, target)
    # Other weights than the checkpoint's, so only the reshard can bring them back.
    worker.load_weights((n, t * 1.5 + 0.01) for n, t in want["weights"].items())
    target_layout = parallel_layout(mc, world=world).record()
    done = restore_rank(folder, worker, rank=rank, world_size=world, layout=target_layout)
    sides["resharded"] = done is not None
    sides["got"] = _hf_state(worker)
    sides["got_next"] = _next(worker, rollout)
    return sides


def _next(worker: Any, rollout: Any) -> dict[str, Any]:
    forward = worker.forward(rollout, capture_routes=True)
    step = worker.train_step(rollout, loss_fn=_loss, micro_batch_size=2, entropy=True)
    return {"logprobs": forward.logprobs, "loss": step.loss, "grad_norm": step.grad_norm}


def check_resumed(name: str, sides: dict[str, Any]) -> None:
    """The resumed state is the saved one bit for bit, and it scores and steps as the
    saved worker does (to the layouts' rounding)."""
    assert sides["resharded"], f"{name}: read as its own layout"
    for part in ("weights", "exp_avg", "exp_avg_sq", "step"):
        want, got = sides["want"][part], sides["got"][part]
        assert want.keys() == got.keys(), (name, part)
        for key, value in want.items():
            assert torch.equal(value, got[key]), (name, part, key)
    want, got = sides["want_next"], sides["got_next"]
    assert close(got["logprobs"], want["logprobs"]) <= TOL, name
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL), name
    assert abs(got["grad_norm"] - want["grad_norm"]) <= TOL * want["grad_norm"], name


def _wrong_shard_agreement(worker: Any, rollout: Any) -> float:
    """Agreement when this rank is handed another rank's share of the routes: under
    sequence parallelism the next TP rank's sequence slice, in a pipeline the next
    stage's layers, else (each rank replays whole rows) another data-parallel rank's
    rows, the batch's routes shifted by one row."""
    assert worker.routers is not None
    right = worker.routers
    routers, routes = right, rollout.routed_experts
    if right.sequence_shards > 1:
        routers = dataclasses.replace(
            right, sequence_shard=(right.sequence_shard + 1) % right.sequence_shards
        )
    elif len(right.layers) < right.num_layers:
        # The captured routes are placed by the true layers: only the input moves.
        routes = routes.roll(len(right.layers), 2)
    else:
        routes = routes.roll(1, 0)
    shifted = dataclasses.replace(rollout, routed_experts=routes)
    worker.routers = routers
    try:
        swapped = worker.forward(shifted, capture_routes=True)
    finally:
        worker.routers = right
    return agreement(swapped.routes, rollout.routed_experts, rollout)


def check_expert_shards(worker: Any, arch: Any, mc: MegatronConfig) -> None:
    """Experts are split over the expert-parallel ranks and cut over the expert tensor
    ones only: under TP=2 x EP=2 at ETP=1 each rank holds half the experts, whole; and
    this rank's MoE layers are its pipeline stage's (its chunks' under VPP)."""
    from megatron.core import parallel_state

    ep = mc.expert_model_parallel_size
    etp = mc.expert_tensor_parallel_size or mc.tensor_model_parallel_size
    assert parallel_state.get_expert_tensor_parallel_world_size() == etp
    assert parallel_state.get_expert_model_parallel_world_size() == ep
    width = 2 * arch.moe_ffn_hidden_size // etp  # [gate; up] rows
    seen, local = 0, 0
    for chunk in worker.chunks:
        for layer in chunk.decoder.layers:
            local += int(layer.layer_number - 1 in arch.moe_layers)
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            seen += 1
            assert len(experts.local_experts) == arch.num_experts // ep
            for expert in experts.local_experts:
                assert tuple(expert.linear_fc1.weight.shape) == (width, arch.hidden_size)
    assert seen == local > 0
    if mc.pipeline_model_parallel_size == 1:
        assert seen == len(arch.moe_layers)


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def checkpoint(
    name: str, *, model: TinyMoEConfig | None = None, sizes: Any = None, vocab: int | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The built-in model (``model``, default ``TinyMoEConfig()``), or a family's tiny
    checkpoint as transformers builds it at ``sizes`` (default ``TinySizes()``; norm
    weights moved off 1, as test_megatron_families.py does, so a misplaced norm shows);
    ``vocab``: another vocabulary size than the model's default."""
    if name == "builtin":
        cfg = model or TinyMoEConfig()
        cfg = cfg if vocab is None else dataclasses.replace(cfg, vocab_size=vocab)
        return cfg.architecture(), build_hf_model(cfg, seed=1).state_dict()
    from transformers import AutoModelForCausalLM

    from inference.models.architecture import TinySizes
    from inference.models.families import FAMILIES, describe

    torch.manual_seed(0)
    sizes = sizes or TinySizes()
    if vocab is not None:
        sizes = dataclasses.replace(sizes, vocab_size=vocab)
    model_ = AutoModelForCausalLM.from_config(FAMILIES[name].tiny_config(sizes))
    with torch.no_grad():
        for param in model_.parameters():
            if param.min() == param.max():
                param.add_(0.1 * torch.randn_like(param))
    return describe(model_.config), {n: p.detach() for n, p in model_.named_parameters()}


def compare(
    name: str, rank: int, hf_state: dict[str, torch.Tensor], ref: dict, got: dict
) -> dict[str, float]:
    """The Target: the layout (``got``) against the one-rank reference (``ref``); the
    worst differences, for the test's table."""
    for key in ("r3_forward", "r3_step", "r2_step"):
        if key in got:
            assert ref[key] == 1.0 and got[key] == 1.0, (name, key, ref[key], got[key])
    # A shard handed to the wrong rank must fail: most routers then see another
    # token's (or layer's) routes.
    if "swapped" in got:
        assert got["swapped"] < 0.5, (name, got["swapped"])
    if "own_routes" in got:
        assert torch.equal(got["own_routes"], ref["own_routes"]), name
    assert close(got["logprobs"], ref["logprobs"]) <= TOL, name
    assert close(got["entropy"], ref["entropy"]) <= TOL, name
    for suffix in ("", "2") if "loss2" in got else ("",):
        loss, want_loss = got["loss" + suffix], ref["loss" + suffix]
        # Equal to fp32 rounding of per-token logprobs that agree to TOL (measured: 1.0e-6
        # relative on qwen3_moe).
        assert loss == pytest.approx(want_loss, rel=TOL), (name, loss, want_loss)
        norm, want = got["grad_norm" + suffix], ref["grad_norm" + suffix]
        assert abs(norm - want) <= TOL * want, (name, suffix, norm, want)
        assert want > 1.0  # the clip at 1.0 acted, over the layout's whole norm
    # The first step's gradients, clipped, element by element, and its weights where
    # AdamW's first step is not a sign of rounding (_step_checks.steady).
    grads, want_grads = got["grads"], ref["grads"]
    names = list(hf_state)
    worst = {
        "logprobs": close(got["logprobs"], ref["logprobs"]),
        "entropy": close(got["entropy"], ref["entropy"]),
        "loss": abs(got["loss"] / ref["loss"] - 1),
        "grad_norm": abs(got["grad_norm"] / ref["grad_norm"] - 1),
        "grads": max(close(grads[n], want_grads[n]) for n in names),
        "weights": steady_worst(got["weights"], ref["weights"], want_grads),
        "swapped": got.get("swapped", float("nan")),
    }
    assert worst["grads"] <= TOL, name
    assert worst["weights"] <= TOL, name
    moved = max(close(ref["weights"][n], hf_state[n]) for n in hf_state)
    assert moved > 1e-3  # the step changed the weights the comparison reads
    if rank == 0:
        below = sum(int((~steady(ref["grads"][n])).sum()) for n in names)
        print(
            f"{name} vs one rank: logprobs {worst['logprobs']:.2e}, entropy "
            f"{worst['entropy']:.2e}, grad norm {got['grad_norm']:.6f} vs "
            f"{ref['grad_norm']:.6f}, clipped grads {worst['grads']:.2e}, weights "
            f"{max(close(got['weights'][n], ref['weights'][n]) for n in names):.2e} "
            f"({worst['weights']:.2e} on gradients >= 1e-6; {below} of "
            f"{sum(t.numel() for t in hf_state.values())} below), swapped-shard "
            f"agreement {worst['swapped']:.3f}"
        )
    return worst
