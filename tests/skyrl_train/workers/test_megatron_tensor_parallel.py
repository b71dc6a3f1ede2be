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
Packed microbatches (``trainer.remove_microbatch_padding``) run in the same launch at
each layout proven padded (``PACKED``), against the padded one-rank reference.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _layout_checks import checkpoint, compare, run_case
from _ranks import run_group

from skyrl_train.workers.megatron.replay import to_sequence_first

WORLD = 2
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
PACKED: dict[str, dict[str, Any]] = {
    # The train microbatches hold 15 and 12 tokens: SP pads the first to 16.
    "TP=2": {"tensor_model_parallel_size": 2},
    "EP=2": {"expert_model_parallel_size": 2},
    "EP=2, alltoall": {"expert_model_parallel_size": 2, **ALLTOALL},
    "TP=2 x EP=2 (ETP=1)": TP2XEP2,
    "TP=2 x EP=2 (ETP=1), alltoall": {**TP2XEP2, **ALLTOALL},
    # Four layers over two stages of two chunks: every microbatch one packed length.
    "PP=2 x VPP=2": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
}
"""Packed layouts on the built-in model (about 1 s each here)."""


def _rank_main(rank: int) -> None:
    for name in CASES:
        arch, hf_state = checkpoint(name)
        ref = run_case(arch, {}, hf_state)
        for layout, (settings, cases) in LAYOUTS.items():
            if name in cases:
                got = run_case(arch, settings, hf_state)
                compare(f"{name} {layout}", rank, hf_state, ref, got)
    _odd_vocabularies(rank)
    _packed_layouts(rank)


def _packed_layouts(rank: int) -> None:
    arch, hf_state = checkpoint("builtin")
    ref = run_case(arch, {}, hf_state, r3_only=True)
    for layout, settings in PACKED.items():
        got = run_case(arch, settings, hf_state, r3_only=True, packed=True)
        assert got["attention"] == "PackedDotProductAttention", layout
        # Agreement 1.0 (the forward's rows reordered), log-probs, grads, weights.
        compare(f"builtin packed {layout}", rank, hf_state, ref, got)
        # Measured: at most 9.5e-7 (TP=2 x EP=2), one fp32 ulp of the loss.
        loss, want = got["loss"], ref["loss"]
        assert loss == pytest.approx(want, rel=1e-6, abs=1e-6), (layout, loss, want)


def _odd_vocabularies(rank: int) -> None:
    for name, (vocab, multiple, rows) in ODD_VOCAB.items():
        arch, hf_state = checkpoint(name, vocab=vocab)
        # The R3 forward and step: the R2 step and the swapped shard score as they do.
        ref = run_case(arch, {}, hf_state, r3_only=True)
        settings = {"tensor_model_parallel_size": 2, "make_vocab_size_divisible_by": multiple}
        got = run_case(arch, settings, hf_state, r3_only=True)
        assert "rows" not in ref and got["rows"] == rows, (name, got.get("rows"))
        # Measured: at most 1.5e-7 relative.
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), (name, got["loss"], ref["loss"])
        compare(f"{name} vocabulary {vocab} TP=2", rank, hf_state, ref, got)


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
