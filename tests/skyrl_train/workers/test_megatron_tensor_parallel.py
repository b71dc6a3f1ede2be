"""Tensor parallelism (TP=2, sequence parallelism on), alone and with expert parallelism
(TP=2 x EP=2 at expert tensor size 1: megatron-core's MoE parallel folding), against the
single-rank reference, on two gloo processes: same batch, same weights, fp32, routes
replayed (R3) and then the routes the trainer's own routers chose (R2), a kept-set
sampler at temperature 0.7, an entropy bonus and a KL term in the loss, gradients
clipped. Every layout runs in one process group: the reference is TP=1 with both ranks
given the same whole batch (two data-parallel replicas of one rank: their averaged
gradient is that rank's, exactly). The alltoall token dispatcher is compared too (the
worker's default is allgather); flex needs DeepEP or HybridEP on a GPU and is refused.
A vocabulary of 381 ids, which TP=2 does not divide, trains padded (``ODD_VOCAB``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _megatron_batches import PAD_ID, make_batch, random_routes
from _ranks import run_group
from _step_checks import clipped_grads, steady, steady_worst

from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.workers.megatron.replay import to_sequence_first

CFG = TinyMoEConfig()
ARCH = CFG.architecture()
L, E, K = CFG.num_layers, CFG.num_experts, CFG.num_experts_per_tok
WORLD = 2
PROMPTS = [[72, 105, 33], [1, 2, 3, 4, 5], [40, 41], [9, 8, 7, 6]]
RESPONSES = [[50, 51, 52, 53], [60, 61, 62], [70, 71, 72, 73], [80, 81]]
# The Target of issue 39 (docs/parallel-layouts.md).
TOL = 1e-5
# OLMoE is refused at TP > 1 (its q/k norm spans every head: test_megatron_checks.py).
CASES = ("builtin", "qwen3_moe", "qwen2_moe", "mixtral")
ALLTOALL = {"transformer_config_kwargs": {"moe_token_dispatcher_type": "alltoall"}}
TP2XEP2 = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
           "expert_tensor_parallel_size": 1}  # fmt: skip
# Layout -> (MegatronConfig settings, the checkpoints it runs). The launch's layouts
# (TP=2, TP=2 x EP=2) run every family; the other dispatcher cases, the built-in model.
LAYOUTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "TP=2": ({"tensor_model_parallel_size": 2}, CASES),
    "TP=2 x EP=2 (ETP=1)": (TP2XEP2, CASES),
    "TP=2 x EP=2 (ETP=1), alltoall": ({**TP2XEP2, **ALLTOALL}, CASES),
    "TP=2, alltoall": ({"tensor_model_parallel_size": 2, **ALLTOALL}, ("builtin",)),
    "EP=2, alltoall": ({"expert_model_parallel_size": 2, **ALLTOALL}, ("builtin",)),
    # Two data-parallel replicas, each a one-rank model: the dispatcher only permutes.
    "DP=2, alltoall": (ALLTOALL, ("builtin",)),
}
# A vocabulary of 381 ids (odd, as added special tokens leave real ones), which TP=2
# does not divide: padded to 382 rows by the default rule and to 512 by Megatron's own
# default (m=128: the second shard holds 125 ids and 131 padded rows). Checkpoint ->
# (vocabulary, make_vocab_size_divisible_by, the padded rows).
ODD_VOCAB: dict[str, tuple[int, int, int]] = {"builtin": (381, 1, 382), "mixtral": (381, 128, 512)}


def _batch(routes: torch.Tensor) -> Any:
    per_row = [routes[b, : len(PROMPTS[b]) + len(RESPONSES[b]) - 1] for b in range(4)]
    layers, top_k = routes.shape[2], routes.shape[3]
    batch = make_batch(PROMPTS, RESPONSES, num_layers=layers, top_k=top_k, routes=per_row)
    # Kept sets across both vocabulary shards (264 ids: [0, 132) and [132, 264)), the
    # sampled token among them; a row of -1 keeps the whole vocabulary.
    support = torch.full((4, batch.num_actions, 5), -1, dtype=torch.int64)
    for b, response in enumerate(RESPONSES):
        for j, token in enumerate(response[:-1]):
            support[b, j] = torch.tensor([token, 140, 7, 200 + j, 263])
    return dataclasses.replace(batch, sample_support=support)


def _agreement(got: torch.Tensor, want: torch.Tensor, batch: Any) -> float:
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


def _run_case(
    arch: Any, layout: dict[str, Any], hf_state: dict[str, torch.Tensor], *, r3_only: bool = False
) -> dict[str, Any]:
    """``r3_only``: the R3 forward and train step alone (no R2 step, no swapped shard)."""
    from skyrl_train.workers.megatron import MegatronPolicyWorker

    mc = MegatronConfig(moe_enable_routing_replay=True, **layout)
    worker = MegatronPolicyWorker(
        arch,
        mc,
        optimizer=OptimizerConfig(lr=1e-2, max_grad_norm=1.0),
        pad_token_id=PAD_ID,
        temperature=0.7,
    ).setup()
    _check_expert_shards(worker, arch, mc)
    worker.load_weights(hf_state.items())
    tp = mc.tensor_model_parallel_size
    layers, experts, top_k = len(arch.moe_layers), arch.num_experts, arch.num_experts_per_tok
    rollout = _batch(random_routes(4, 9, layers, experts, top_k, seed=11))
    out: dict[str, Any] = {}
    rows = worker.chunks[0].embedding.word_embeddings.weight.shape[0] * tp
    if rows != arch.vocab_size:
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
    first = worker.forward(rollout, capture_routes=True, entropy=True)
    out["logprobs"], out["entropy"] = first.logprobs, first.entropy
    out["r3_forward"] = _agreement(first.routes, rollout.routed_experts, rollout)
    rollout = dataclasses.replace(rollout, rollout_logprobs=first.logprobs)
    if not r3_only:
        # R2's source: what the trainer's routers choose themselves (no replay).
        own = worker.forward(dataclasses.replace(rollout, routed_experts=None), capture_routes=True)
        out["own_routes"] = own.routes
    step = worker.train_step(
        rollout, loss_fn=_loss, micro_batch_size=2, entropy=True, capture_routes=True
    )
    out["r3_step"] = _agreement(step.routes, rollout.routed_experts, rollout)
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
    out["r2_step"] = _agreement(step2.routes, own.routes, r2)
    out["loss2"], out["grad_norm2"] = step2.loss, step2.grad_norm
    if tp > 1:
        # The same replay with each rank's routers fed the other rank's sequence shard.
        assert worker.routers is not None
        right = worker.routers
        worker.routers = dataclasses.replace(right, sequence_shard=1 - right.sequence_shard)
        try:
            swapped = worker.forward(rollout, capture_routes=True)
        finally:
            worker.routers = right
        out["swapped"] = _agreement(swapped.routes, rollout.routed_experts, rollout)
    return out


def _check_expert_shards(worker: Any, arch: Any, mc: MegatronConfig) -> None:
    """Experts are split over the expert-parallel ranks and cut over the expert tensor
    ones only: under TP=2 x EP=2 at ETP=1 each rank holds half the experts, whole."""
    from megatron.core import parallel_state

    ep = mc.expert_model_parallel_size
    etp = mc.expert_tensor_parallel_size or mc.tensor_model_parallel_size
    assert parallel_state.get_expert_tensor_parallel_world_size() == etp
    assert parallel_state.get_expert_model_parallel_world_size() == ep
    width = 2 * arch.moe_ffn_hidden_size // etp  # [gate; up] rows
    seen = 0
    for chunk in worker.chunks:
        for layer in chunk.decoder.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            seen += 1
            assert len(experts.local_experts) == arch.num_experts // ep
            for expert in experts.local_experts:
                assert tuple(expert.linear_fc1.weight.shape) == (width, arch.hidden_size)
    assert seen == len(arch.moe_layers)


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _rank_main(rank: int) -> None:
    for name in CASES:
        arch, hf_state = _checkpoint(name)
        ref = _run_case(arch, {}, hf_state)
        for layout, (settings, cases) in LAYOUTS.items():
            if name in cases:
                got = _run_case(arch, settings, hf_state)
                _compare(f"{name} {layout}", rank, hf_state, ref, got)
    _odd_vocabularies(rank)


def _odd_vocabularies(rank: int) -> None:
    for name, (vocab, multiple, rows) in ODD_VOCAB.items():
        arch, hf_state = _checkpoint(name, vocab=vocab)
        # The R3 forward and step: the R2 step and the swapped shard score as they do.
        ref = _run_case(arch, {}, hf_state, r3_only=True)
        settings = {"tensor_model_parallel_size": 2, "make_vocab_size_divisible_by": multiple}
        got = _run_case(arch, settings, hf_state, r3_only=True)
        assert "rows" not in ref and got["rows"] == rows, (name, got.get("rows"))
        # Measured: at most 1.5e-7 relative.
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), (name, got["loss"], ref["loss"])
        _compare(f"{name} vocabulary {vocab} TP=2", rank, hf_state, ref, got)


def _checkpoint(name: str, *, vocab: int | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """The built-in model, or a family's tiny checkpoint as transformers builds it (norm
    weights moved off 1, as test_megatron_families.py does, so a misplaced norm shows);
    ``vocab``: another vocabulary size than the model's default."""
    if name == "builtin":
        cfg = CFG if vocab is None else dataclasses.replace(CFG, vocab_size=vocab)
        return cfg.architecture(), build_hf_model(cfg, seed=1).state_dict()
    from transformers import AutoModelForCausalLM

    from inference.models.architecture import TinySizes
    from inference.models.families import FAMILIES, describe

    torch.manual_seed(0)
    sizes = TinySizes() if vocab is None else TinySizes(vocab_size=vocab)
    model = AutoModelForCausalLM.from_config(FAMILIES[name].tiny_config(sizes))
    with torch.no_grad():
        for param in model.parameters():
            if param.min() == param.max():
                param.add_(0.1 * torch.randn_like(param))
    return describe(model.config), {n: p.detach() for n, p in model.named_parameters()}


def _compare(name: str, rank: int, hf_state: dict[str, torch.Tensor], ref: dict, got: dict) -> None:
    """The Target: TP=2 (``got``) against the one-rank reference (``ref``)."""
    for key in ("r3_forward", "r3_step", "r2_step"):
        if key in got:
            assert ref[key] == 1.0 and got[key] == 1.0, (name, key, ref[key], got[key])
    # A permuted shard must fail: most routers then see another token's routes.
    if "swapped" in got:
        assert got["swapped"] < 0.5, got["swapped"]
    if "own_routes" in got:
        assert torch.equal(got["own_routes"], ref["own_routes"])
    assert _close(got["logprobs"], ref["logprobs"]) <= TOL
    assert _close(got["entropy"], ref["entropy"]) <= TOL
    for suffix in ("", "2") if "loss2" in got else ("",):
        loss, want_loss = got["loss" + suffix], ref["loss" + suffix]
        # Equal to fp32 rounding of per-token logprobs that agree to TOL (measured: 1.0e-6
        # relative on qwen3_moe).
        assert loss == pytest.approx(want_loss, rel=TOL), (name, loss, want_loss)
        norm, want = got["grad_norm" + suffix], ref["grad_norm" + suffix]
        assert abs(norm - want) <= TOL * want, (suffix, norm, want)
        assert want > 1.0  # the clip at 1.0 acted, over the TP group's norm
    # The first step's gradients, clipped, element by element, and its weights where
    # AdamW's first step is not a sign of rounding (_step_checks.steady).
    grads, want_grads = got["grads"], ref["grads"]
    assert max(_close(grads[n], want_grads[n]) for n in want_grads) <= TOL
    assert steady_worst(got["weights"], ref["weights"], want_grads) <= TOL
    moved = max(_close(ref["weights"][n], hf_state[n]) for n in hf_state)
    assert moved > 1e-3  # the step changed the weights the comparison reads
    if rank == 0:
        names = list(hf_state)
        below = sum(int((~steady(ref["grads"][n])).sum()) for n in names)
        worst = steady_worst(got["weights"], ref["weights"], ref["grads"])
        print(
            f"{name} vs TP=1: logprobs {_close(got['logprobs'], ref['logprobs']):.2e}, "
            f"entropy {_close(got['entropy'], ref['entropy']):.2e}, grad norm "
            f"{got['grad_norm']:.6f} vs {ref['grad_norm']:.6f}, clipped grads "
            f"{max(_close(got['grads'][n], ref['grads'][n]) for n in names):.2e}, weights "
            f"{max(_close(got['weights'][n], ref['weights'][n]) for n in names):.2e} "
            f"({worst:.2e} on gradients >= 1e-6; {below} of "
            f"{sum(t.numel() for t in hf_state.values())} below), swapped-shard "
            f"agreement {got.get('swapped', float('nan')):.3f}"
        )


# Hang guard only, as in test_megatron_expert_parallel.py (start-up of two interpreters
# dominates and scales with the machine's load).
@pytest.mark.timeout(600)
def test_tensor_parallel_with_sequence_parallel_matches_one_rank(
    tmp_path,
) -> None:
    run_group(_rank_main, args=(), nprocs=WORLD, rendezvous=tmp_path / "rendezvous")


def test_each_sequence_parallel_rank_gets_its_own_contiguous_slice_sequence_first() -> None:
    # Route ids encode (batch row, position): rank r of n must get positions
    # [r*S/n, (r+1)*S/n) in Megatron's sequence-first row order s*B + b.
    batch, seq, shards = 3, 8, 2
    b_idx = torch.arange(batch)[:, None].expand(batch, seq)
    s_idx = torch.arange(seq)[None, :].expand(batch, seq)
    routes = torch.stack([b_idx, s_idx], dim=-1)[:, :, None, :]  # [B, S, 1, 2]
    for shard in range(shards):
        routers = SimpleNamespace(route_layers=(0,), sequence_shards=shards, sequence_shard=shard)
        (rows,) = to_sequence_first(routes, routers)  # type: ignore[arg-type]
        local = seq // shards
        want = [[b, s] for s in range(shard * local, (shard + 1) * local) for b in range(batch)]
        assert rows.tolist() == want


def test_expert_gradients_add_up_over_expert_data_parallel_ranks_without_dense_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # TP=4 x EP=2 x ETP=1 (4 ranks): no dense data-parallel ranks, but two ranks hold
    # each expert, each having dispatched its own sequence shard's tokens to it. A unit
    # test of the one layer: no model here has the KV heads to run TP=4.
    from megatron.core import parallel_state

    from skyrl_train.workers.megatron.gradients import average_data_parallel_grads

    dense_group, expert_group = object(), object()
    sizes = {"data": 1, "expert_data": 2}
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda: sizes["data"])
    monkeypatch.setattr(
        parallel_state, "get_expert_data_parallel_world_size", lambda: sizes["expert_data"]
    )
    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda: dense_group)
    monkeypatch.setattr(parallel_state, "get_expert_data_parallel_group", lambda: expert_group)
    reduced: list[object] = []

    def all_reduce(tensor: torch.Tensor, group: object) -> None:
        reduced.append(group)
        tensor.mul_(2)  # the other rank's part, equal here

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    dense, expert = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    expert.allreduce = False  # type: ignore[attr-defined]  # how megatron-core marks experts
    dense.grad, expert.grad = torch.ones(3), torch.ones(3)
    average_data_parallel_grads([dense, expert])
    assert reduced == [expert_group]
    assert expert.grad.tolist() == [2.0] * 3  # summed, and scaled by the dense DP size 1
    assert dense.grad.tolist() == [1.0] * 3
    # Two dense replicas as well (TP=2 x EP=2 x ETP=1 on 8 ranks): both sums, both / 2.
    sizes["data"] = 2
    dense.grad, expert.grad = torch.ones(3), torch.ones(3)
    reduced.clear()
    average_data_parallel_grads([dense, expert])
    assert reduced == [dense_group, expert_group]
    assert dense.grad.tolist() == expert.grad.tolist() == [1.0] * 3


def test_one_function_names_a_parameters_tensor_parallel_group_for_every_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # TP=2 with ETP=1: a dense shard spans the dense group, an expert shard the expert
    # one, and the norm's reduction asks the same function as loading and export do.
    from megatron.core import parallel_state

    from skyrl_train.workers.megatron.gradients import clip_grad_norm
    from skyrl_train.workers.megatron.tensor_parallel import tensor_parallel_of

    dense_group, expert_group = object(), object()
    answers = {
        "tensor_model_parallel_rank": 1,
        "tensor_model_parallel_world_size": 2,
        "tensor_model_parallel_group": dense_group,
        "expert_tensor_parallel_rank": 0,
        "expert_tensor_parallel_world_size": 1,
        "expert_tensor_parallel_group": expert_group,
        "expert_model_parallel_world_size": 1,
    }
    for name, value in answers.items():
        monkeypatch.setattr(parallel_state, f"get_{name}", lambda v=value: v)
    whole, dense, expert = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    dense.tensor_model_parallel = expert.tensor_model_parallel = True  # type: ignore[attr-defined]
    expert.allreduce = False  # type: ignore[attr-defined]  # how megatron-core marks experts
    assert tuple(tensor_parallel_of(whole)) == (0, 1, None)
    assert tuple(tensor_parallel_of(dense)) == (1, 2, dense_group)
    assert tuple(tensor_parallel_of(expert)) == (0, 1, expert_group)
    reduced: list[object] = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group: reduced.append(group))
    for p in (whole, dense, expert):
        p.grad = torch.ones(2)
    pipeline = SimpleNamespace(sum_over_stages=lambda sq: sq)
    norm = clip_grad_norm([whole, dense, expert], max_norm=0.0, pipeline=pipeline)  # type: ignore[arg-type]
    assert reduced == [dense_group]  # the expert group has one rank: nothing to add
    assert norm == pytest.approx(6**0.5)


def test_only_tensor_parallel_py_reads_a_parameters_tensor_parallel_markers() -> None:
    # Two readers of megatron-core's markers gave two answers to which group a
    # parameter spans (issue 50); every caller now asks tensor_parallel.py.
    import re
    from pathlib import Path

    import skyrl_train

    marker = re.compile(r"""["'](allreduce|tensor_model_parallel)["']""")
    root = Path(skyrl_train.__file__).parent
    readers = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if marker.search(path.read_text(encoding="utf-8"))
    )
    assert readers == ["workers/megatron/tensor_parallel.py"]
