"""The Megatron worker on a real tiny MoE GPTModel (world size 1, gloo, CPU shim):
weight conversion both ways, exact replay, router gradients, state cleanup, and R3
against routes recorded by the bf16 inference engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _megatron_batches import PAD_ID, hf_response_logprobs, make_batch, random_routes
from _megatron_oracles import record_routes, router_agreement

from inference.engine.base import EngineRequest, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from inference.models.tokenizer import build_byte_tokenizer
from skyrl_train.config.schema import MegatronConfig, OptimizerConfig
from skyrl_train.errors import RouteReplayError
from skyrl_train.workers.megatron import MegatronPolicyWorker
from skyrl_train.workers.megatron.cpu_compat import apply_cpu_compat
from skyrl_train.workers.megatron.model import causal_attention_mask

CFG = TinyMoEConfig()
ARCH = CFG.architecture()
L, E, K = CFG.num_layers, CFG.num_experts, CFG.num_experts_per_tok


@pytest.fixture(scope="module")
def worker() -> MegatronPolicyWorker:
    torch.set_num_threads(1)
    w = MegatronPolicyWorker(
        ARCH,
        MegatronConfig(moe_enable_routing_replay=True),
        optimizer=OptimizerConfig(lr=1e-3),
        pad_token_id=PAD_ID,
    ).setup()
    return w


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return build_hf_model(CFG, seed=1)


def _replay_state_is_clear() -> bool:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    instances = RouterReplay.global_router_replay_instances
    return len(instances) == L and all(
        r.target_topk_idx is None
        and r.recorded_topk_idx is None
        and r.replay_backward_list == []
        and r.router_replay_action is None
        for r in instances
    )


def _text_batch(**kwargs) -> object:
    prompts = [[72, 105, 33], [1, 2, 3, 4, 5, 6], [40, 41]]
    responses = [[50, 51, 52, 53], [60, 61], [70, 71, 72, 73, 74]]
    return make_batch(prompts, responses, num_layers=L, top_k=K, **kwargs)


def test_cpu_shim_is_idempotent() -> None:
    assert apply_cpu_compat() is True
    assert apply_cpu_compat() is True
    assert torch.cuda.current_device() == "cpu"


def test_hf_to_megatron_conversion_gives_the_same_logits(worker, hf_model) -> None:
    assert worker.load_weights(hf_model.state_dict().items()) == len(hf_model.state_dict())
    tokens = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    worker.model.eval()
    with torch.no_grad():
        ref = hf_model(tokens).logits
        got = worker.model(tokens, torch.arange(24)[None].expand(2, 24), causal_attention_mask(24))
    assert (ref - got).abs().max().item() <= 1e-4


def test_megatron_to_hf_export_gives_the_same_logits(worker, hf_model) -> None:
    worker.load_weights(hf_model.state_dict().items())
    exported = worker.export_weights()
    first = next(exported)
    assert first[0] == "model.embed_tokens.weight"  # a stream, not a dict
    other = build_hf_model(CFG, seed=7)
    state = dict([first, *exported])
    assert set(state) == set(other.state_dict())
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (
        E,
        2 * CFG.moe_intermediate_size,
        CFG.hidden_size,
    )
    other.load_state_dict(state)
    tokens = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (other(tokens).logits - hf_model(tokens).logits).abs().max().item() <= 1e-4


def test_bad_weight_names_and_shapes_are_refused(worker, hf_model) -> None:
    with pytest.raises(
        ValueError, match=r"model.layers.9.mlp.gate.weight: expected a Qwen3MoeForCausalLM weight"
    ):
        worker.load_weights([("model.layers.9.mlp.gate.weight", torch.zeros(E, CFG.hidden_size))])
    with pytest.raises(ValueError, match=r"model.norm.weight.shape: expected \(64,\), got \(3,\)"):
        worker.load_weights([("model.norm.weight", torch.zeros(3))])
    q = hf_model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.0: expected all of \['self_attn.q_proj"):
        worker.load_weights([("model.layers.0.self_attn.q_proj.weight", q)])


def test_left_padded_logprobs_match_hf_on_unpadded_rows(worker, hf_model) -> None:
    worker.load_weights(hf_model.state_dict().items())
    batch = _text_batch()
    got = worker.forward(batch, micro_batch_size=2).logprobs
    assert got.shape == (3, 5)
    assert (got - hf_response_logprobs(hf_model, batch)).abs().max().item() <= 1e-4
    assert torch.all(got[batch.response_mask == 0] == 0)


def test_forward_entropy_matches_hf_on_response_positions(worker, hf_model) -> None:
    worker.load_weights(hf_model.state_dict().items())
    batch = _text_batch()
    result = worker.forward(batch, micro_batch_size=2, entropy=True)
    assert result.entropy is not None and result.entropy.shape == (3, 5)
    assert torch.equal(result.logprobs, worker.forward(batch, micro_batch_size=2).logprobs)
    width = batch.sequences.shape[1] - batch.num_actions
    with torch.no_grad():
        for b in range(batch.batch_size):
            real = batch.attention_mask[b].bool()
            tokens = batch.sequences[b][real][None]
            prompt_len = int(real[:width].sum())
            count = int(batch.response_mask[b].sum())
            logp = torch.log_softmax(hf_model(tokens).logits[0].float(), dim=-1)
            ref = -(logp.exp() * logp).sum(-1)[prompt_len - 1 : prompt_len - 1 + count]
            assert (result.entropy[b, :count] - ref).abs().max().item() <= 1e-4
    assert torch.all(result.entropy[batch.response_mask == 0] == 0)
    assert worker.forward(batch).entropy is None


def test_replay_forces_the_given_experts_and_router_still_learns(worker, hf_model) -> None:
    worker.load_weights(hf_model.state_dict().items())
    plain = _text_batch()
    seq = plain.sequences.shape[1]
    forced = random_routes(3, seq, L, E, K, seed=3)
    routes = [forced[b, plain.attention_mask[b].bool()] for b in range(3)]
    batch = _text_batch(routes=routes)
    natural = worker.forward(batch, replay_routes=False, capture_routes=True).routes
    replayed = worker.forward(batch, replay_routes=True, capture_routes=True).routes
    real = ~batch.router_padding_mask
    want = batch.routed_experts.sort(-1).values
    assert torch.equal(replayed[real], want[real])  # every real token, every layer
    assert (natural[real] != want[real]).any(-1).float().mean() > 0.5  # really differs
    assert router_agreement(worker, batch, replay_routes=True) == 1.0
    assert _replay_state_is_clear()

    # Replay fixes the selection, not the weights: the router still gets a gradient.
    worker.optimizer.param_groups[0]["lr"] = 0.0
    step = worker.train_step(batch, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=3)
    assert step.replayed
    for layer in worker.model.decoder.layers:
        grad = layer.mlp.router.weight.grad
        assert grad is not None and grad.abs().sum().item() > 0
    assert _replay_state_is_clear()


def test_record_mode_reports_the_trainers_own_routes(worker, hf_model) -> None:
    worker.load_weights(hf_model.state_dict().items())
    batch = _text_batch()
    recorded = record_routes(worker, batch)
    dispatched = worker.forward(batch, replay_routes=False, capture_routes=True).routes
    real = batch.attention_mask.bool()
    assert torch.equal(recorded[real].sort(-1).values, dispatched[real])
    assert _replay_state_is_clear()


def test_only_each_microbatchs_routes_enter_the_routers(worker, monkeypatch) -> None:
    from skyrl_train.workers.megatron.replay import KeyedReplay

    armed: list[tuple[int, int, tuple[int, ...]]] = []
    original = KeyedReplay.arm

    def spy(self, chunk: int, microbatch: int) -> None:
        original(self, chunk, microbatch)
        targets = [m.router_replay.target_topk_idx for m in worker.routers.modules]
        armed.append((chunk, microbatch, tuple(tuple(t.shape) for t in targets)))
        # Nothing is queued for a recompute to pop: targets are set, never appended.
        assert all(not m.router_replay.replay_backward_list for m in worker.routers.modules)

    monkeypatch.setattr(KeyedReplay, "arm", spy)
    seq = _text_batch().sequences.shape[1]
    routes = [random_routes(1, seq, L, E, K, seed=b)[0, :4] for b in range(3)]
    worker.forward(_text_batch(routes=routes), micro_batch_size=2)
    assert armed == [(0, 0, ((seq * 2, K),) * L), (0, 1, ((seq * 1, K),) * L)]


def test_exception_mid_schedule_leaves_no_replay_state(worker) -> None:
    seq = _text_batch().sequences.shape[1]
    routes = [random_routes(1, seq, L, E, K, seed=b)[0, :4] for b in range(3)]
    batch = _text_batch(routes=routes)
    calls = []

    def failing_loss(logprobs: torch.Tensor, mb) -> torch.Tensor:
        calls.append(mb.batch_size)
        if len(calls) == 2:
            raise RuntimeError("loss exploded")
        return -logprobs.sum()

    with pytest.raises(RuntimeError, match="loss exploded"):
        worker.train_step(batch, loss_fn=failing_loss, micro_batch_size=2)
    assert calls == [2, 1]
    assert _replay_state_is_clear()
    result = worker.train_step(batch, loss_fn=lambda lp, mb: -lp.sum(), micro_batch_size=2)
    assert result.replayed and result.num_microbatches == 2 and result.grad_norm > 0
    assert _replay_state_is_clear()


def test_bad_routes_are_refused_before_any_forward(worker) -> None:
    seq = _text_batch().sequences.shape[1]
    routes = [random_routes(1, seq, L, E, K, seed=b)[0, :4] for b in range(3)]
    batch = _text_batch(routes=routes)
    batch.routed_experts[2, 4, 1] = torch.tensor([3, 3])
    with pytest.raises(RouteReplayError, match=r"trajectory 'c' \(batch row 2\), layer 1"):
        worker.train_step(
            batch,
            loss_fn=lambda lp, mb: lp.sum(),
            micro_batch_size=1,
            trajectory_ids=["a", "b", "c"],
        )
    assert _replay_state_is_clear()
    no_routes = _text_batch()
    with pytest.raises(RouteReplayError, match="routed_experts: expected routes to replay"):
        worker.forward(no_routes, replay_routes=True)


def test_training_steps_lower_the_loss(worker, hf_model) -> None:
    worker.load_weights(hf_model.state_dict().items())
    batch = _text_batch()

    def nll(logprobs: torch.Tensor, mb) -> torch.Tensor:
        return -(logprobs * mb.loss_mask).sum() / mb.loss_mask.sum()

    first = worker.train_step(batch, loss_fn=nll, micro_batch_size=2)
    for _ in range(3):
        last = worker.train_step(batch, loss_fn=nll, micro_batch_size=2)
    assert not first.replayed
    assert last.loss < first.loss


def test_replay_of_bf16_engine_routes_cuts_logprob_mismatch(worker) -> None:
    """Routes recorded by the bf16 engine during generate(): replay uses them exactly
    (agreement 100%) and the per-token logprob mismatch against the rollout shrinks."""
    engine = HFMoEEngine.from_config(CFG, seed=0)  # bf16, like a real engine
    worker.load_weights(engine.state_dict().items())
    tok = build_byte_tokenizer()
    texts = ["hello world", "the quick brown fox", "MoE routing", "abc", "replay", "x"]
    prompts = [tok.encode(t) for t in texts]
    requests = [
        EngineRequest(
            p, SamplingParams(max_tokens=32, temperature=1.0, seed=i), return_routed_experts=True
        )
        for i, p in enumerate(prompts)
    ]
    outputs = engine.generate_sync(requests)
    batch = make_batch(
        prompts,
        [o.token_ids for o in outputs],
        num_layers=L,
        top_k=K,
        routes=[np.asarray(o.routed_experts) for o in outputs],
        rollout_logprobs=[o.logprobs for o in outputs],
    )
    mask = batch.response_mask.bool()
    gaps = {}
    for replay_on in (False, True):
        logprobs = worker.forward(batch, replay_routes=replay_on, micro_batch_size=3).logprobs
        gaps[replay_on] = (logprobs - batch.rollout_logprobs).abs()[mask]
    flips = 1 - router_agreement(worker, batch, replay_routes=False)
    assert flips > 0  # the seed has routing flips between bf16 and fp32
    assert router_agreement(worker, batch, replay_routes=True) == 1.0
    assert gaps[True].mean() < gaps[False].mean()
    assert gaps[True].max() < gaps[False].max()


def test_a_non_finite_gradient_skips_the_optimizer_step(worker) -> None:
    batch = _text_batch()
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    result = worker.train_step(
        batch, loss_fn=lambda lp, mb: lp.sum() * float("nan"), micro_batch_size=4
    )
    assert not np.isfinite(result.grad_norm)
    # The weights the servers would receive are still the ones before the bad step.
    for name, param in worker.model.named_parameters():
        assert torch.equal(param, before[name]), name
