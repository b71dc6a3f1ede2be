"""Two processes, gloo, EP=2: each rank holds half the experts and only its own shard
of the batch and routes; replay must still dispatch every token to the given experts.
Packed (``trainer.remove_microbatch_padding``), the two ranks' rows pack to different
lengths, which the dispatcher's exchange needs equal: the same numbers again."""

from __future__ import annotations

import pytest
import torch
from _megatron_batches import PAD_ID, hf_response_logprobs, make_batch, random_routes
from _ranks import run_group

from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from skyrl_train.config.schema import MegatronConfig

CFG = TinyMoEConfig()
ARCH = CFG.architecture()
L, E, K = CFG.num_layers, CFG.num_experts, CFG.num_experts_per_tok
WORLD = 2


def _full_batch(seq_routes: bool):
    prompts = [[72, 105, 33], [1, 2, 3, 4, 5], [40, 41], [9, 8, 7, 6]]
    responses = [[50, 51, 52, 53], [60, 61, 62], [70, 71, 72, 73], [80, 81]]
    routes = None
    if seq_routes:
        forced = random_routes(4, 9, L, E, K, seed=11)
        routes = [forced[b, : len(prompts[b]) + len(responses[b]) - 1] for b in range(4)]
    return make_batch(prompts, responses, num_layers=L, top_k=K, routes=routes)


def _rank_main(rank: int) -> None:
    from skyrl_train.dataset.batch import shard_for_data_parallel_rank
    from skyrl_train.workers.megatron import MegatronPolicyWorker

    worker = MegatronPolicyWorker(
        ARCH,
        MegatronConfig(moe_enable_routing_replay=True, expert_model_parallel_size=WORLD),
        pad_token_id=PAD_ID,
    ).setup()
    assert len(worker.model.decoder.layers[0].mlp.experts.local_experts) == E // WORLD
    hf = build_hf_model(CFG, seed=1)
    worker.load_weights(hf.state_dict().items())

    # Expert-parallel forward equals the HF model on this rank's rows.
    shard = shard_for_data_parallel_rank(_full_batch(False), rank=rank, world_size=WORLD)
    got = worker.forward(shard).logprobs
    assert (got - hf_response_logprobs(hf, shard)).abs().max().item() <= 1e-4

    # Replay of random routes: every real token and layer dispatches as given.
    full = _full_batch(True)
    shard = shard_for_data_parallel_rank(full, rank=rank, world_size=WORLD)
    assert torch.equal(shard.routed_experts, full.routed_experts[2 * rank : 2 * rank + 2])
    result = worker.forward(shard, capture_routes=True)
    real = ~shard.router_padding_mask
    assert torch.equal(result.routes[real], shard.routed_experts.sort(-1).values[real])

    # A replayed train step syncs gradients and updates; export gathers all experts.
    step = worker.train_step(shard, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=1)
    assert step.replayed and step.num_microbatches == 2 and step.grad_norm > 0
    exported = dict(worker.export_weights())
    gate_up = exported["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (E, 2 * CFG.moe_intermediate_size, CFG.hidden_size)
    embed = exported["model.embed_tokens.weight"]
    others = [torch.empty_like(embed) for _ in range(WORLD)]
    torch.distributed.all_gather(others, embed)
    assert torch.equal(others[0], others[1])  # dense grads were averaged across ranks
    gathered = [torch.empty_like(gate_up) for _ in range(WORLD)]
    torch.distributed.all_gather(gathered, gate_up)
    assert torch.equal(gathered[0], gathered[1])

    # Packed: rank 0's rows hold 7 + 8 tokens, rank 1's 6 + 6 (one microbatch in the
    # forward, one row each in the step); each is padded to the longer of the two.
    packed = MegatronPolicyWorker(
        ARCH,
        MegatronConfig(moe_enable_routing_replay=True, expert_model_parallel_size=WORLD),
        pad_token_id=PAD_ID,
        remove_microbatch_padding=True,
    ).setup()
    assert packed._prepare(shard, None).inputs[0].tokens.shape == (1, 15)
    packed.load_weights(hf.state_dict().items())
    again = packed.forward(shard, capture_routes=True)
    assert (again.logprobs - result.logprobs).abs().max().item() <= 1e-5
    assert torch.equal(again.routes[real], result.routes[real])
    packed_step = packed.train_step(shard, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=1)
    assert packed_step.loss == pytest.approx(step.loss, rel=1e-6, abs=1e-6)
    assert packed_step.grad_norm == pytest.approx(step.grad_norm, rel=1e-5)


# The wall-clock limit is there to catch a hang, not to time start-up. Over 90% of
# this test is two fresh interpreters importing torch, megatron-core and transformers
# and exiting again; the ranks' own work (forward, replay, train step, gathers) takes
# about 1 s. Start-up scales with whatever else the shared 2-core machine runs, so a
# limit sized to it measures the machine. Measured (2026-12-02): 13 s quiet, 28-30 s
# at load 4-5, 45-61 s beside two busy loops, 95 s at load 12.8; a 120 s limit failed
# with "Timeout (>120.0s)" at about 11 runnable processes per core while both ranks
# were still progressing (mid-forward), not hung. So the limit is the suite's 600 s,
# stated here so that lowering the suite default does not bring the flake back.
@pytest.mark.timeout(600)
def test_two_process_expert_parallel_replay(tmp_path) -> None:
    run_group(_rank_main, args=(), nprocs=WORLD, rendezvous=tmp_path / "rendezvous")
