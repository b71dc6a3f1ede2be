"""The Megatron worker on each supported Hugging Face MoE family, from a checkpoint that
transformers itself wrote: logits, weight round trip, the engine's routes against
Megatron's own, replay, and the route tensor's MoE-only layer axis.

``TinySizes()`` (48 wide, 6 heads of 8, 2 KV heads, 6 experts, top-3, three layers with
a dense first one where the family has dense layers) is deliberately unlike the
built-in model, so these tests cannot lean on its numbers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _megatron_batches import make_batch, random_routes
from _megatron_oracles import record_routes, router_agreement

from inference.engine.base import EngineRequest, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.models.architecture import MoEArchitecture, TinySizes
from inference.models.families import FAMILIES, describe
from inference.models.tiny_moe import TinyMoEConfig
from inference.models.tokenizer import save_byte_tokenizer
from skyrl_train.config.schema import MegatronConfig
from skyrl_train.errors import RouteReplayError
from skyrl_train.workers.megatron import MegatronPolicyWorker
from skyrl_train.workers.megatron.model import causal_attention_mask

SIZES = TinySizes()
PROMPTS = [[72, 105, 33, 10, 40, 41, 42, 43], [1, 2, 3, 4, 5, 6, 7, 8], [200, 9, 8, 7, 6, 5, 4, 3]]
GENERATED = 5


class Case:
    """One family's checkpoint folder, its fp32 HF model and a worker loaded from it."""

    def __init__(self, name: str, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        config = FAMILIES[name].tiny_config(SIZES)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            # Norm weights start at 1 and biases at 0: a norm or bias loaded into the
            # wrong place (or not at all) would not change a single logit.
            for param in model.parameters():
                if param.min() == param.max():
                    param.add_(0.1 * torch.randn_like(param))
        model.save_pretrained(str(folder))
        save_byte_tokenizer(folder)  # the engine's checkpoint check wants one
        self.folder = folder
        self.hf = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=torch.float32
        ).eval()
        self.arch: MoEArchitecture = describe(self.hf.config)
        # Built first, with replay off: building a model resets Megatron's process-global
        # router registry, which would orphan the replaying worker's routers.
        self.blank = MegatronPolicyWorker(
            self.arch, MegatronConfig(), seed=5, routing_replay=False
        ).setup()
        self.worker = MegatronPolicyWorker(self.arch, MegatronConfig(), routing_replay=True).setup()
        self.loaded = self.worker.load_weights(self.hf.named_parameters())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory) -> Case:
    torch.set_num_threads(1)
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def test_the_families_have_the_shapes_these_tests_need(case: Case) -> None:
    arch = case.arch
    assert (arch.hidden_size, arch.num_attention_heads, arch.head_dim) == (48, 6, 8)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.num_layers) == (6, 3, 3)
    assert arch.moe_layers == ((1, 2) if arch.family.startswith("qwen") else (0, 1, 2))
    layers = case.worker.model.decoder.layers
    assert [hasattr(layer.mlp, "router") for layer in layers] == [
        i in arch.moe_layers for i in range(3)
    ]
    assert case.loaded == len(dict(case.hf.named_parameters()))


def test_logits_match_hf_in_fp32(case: Case) -> None:
    tokens = torch.randint(0, SIZES.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    case.worker.model.eval()
    with torch.no_grad():
        ref = case.hf(tokens).logits
        got = case.worker.model(
            tokens, torch.arange(20)[None].expand(3, 20), causal_attention_mask(20)
        )
    delta = (ref - got).abs().max().item()
    print(f"{case.arch.family}: max |logits delta| {delta:.3g}")
    assert delta <= 1e-4


def test_export_import_round_trip_is_bit_exact(case: Case) -> None:
    exported = dict(case.worker.export_weights())
    hf = {name: p.detach() for name, p in case.hf.named_parameters()}
    assert {n: tuple(t.shape) for n, t in exported.items()} == {
        n: tuple(t.shape) for n, t in hf.items()
    }
    assert all(torch.equal(exported[n], hf[n]) for n in hf)
    assert case.blank.load_weights(exported.items()) == len(exported)
    again = dict(case.blank.export_weights())
    assert set(again) == set(exported)
    assert all(torch.equal(again[n], exported[n]) for n in exported)


def test_tensors_a_layer_does_not_have_or_cannot_take_are_refused(case: Case) -> None:
    arch, hf = case.arch, dict(case.hf.named_parameters())
    what = rf"expected a {case.hf.config.architectures[0]} weight name"
    if arch.dense_layers:  # a router for the dense layer 0; its MLP as a fused pair
        stray = ("model.layers.0.mlp.gate.weight", torch.zeros(6, 48))
        half = "model.layers.0.mlp.gate_proj.weight"
        fused = r"\['mlp.gate_proj.weight', 'mlp.up_proj.weight'\] \(fused into mlp.linear_fc1"
    else:  # a dense MLP tensor for an MoE layer; q without k and v
        stray = ("model.layers.0.mlp.down_proj.weight", torch.zeros(48, 80))
        half = "model.layers.0.self_attn.q_proj.weight"
        fused = r"\['self_attn.q_proj.weight', 'self_attn.k_proj.weight', 'self_attn.v_proj"
    with pytest.raises(ValueError, match=rf"^{stray[0]}: {what}"):
        case.blank.load_weights([stray])
    with pytest.raises(ValueError, match=rf"^model.layers.0: expected all of {fused}"):
        case.blank.load_weights([(half, hf[half])])
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(
        ValueError, match=r"^model.layers.0.self_attn.k_proj.weight.shape: expected \(16, 48\)"
    ):
        case.blank.load_weights([("model.layers.0.self_attn.k_proj.weight", k[:-1])])


def test_a_load_takes_the_tensors_in_any_order(case: Case) -> None:
    # Fused parts (q/k/v, [gate; up]) arrive after their siblings here: a checkpoint's
    # shards or the engine's stream need not keep transformers' order.
    exported = list(case.worker.export_weights())
    assert case.blank.load_weights(reversed(exported)) == len(exported)
    again = dict(case.blank.export_weights())
    assert all(torch.equal(again[name], tensor) for name, tensor in exported)


def test_fused_parts_wait_for_their_siblings_and_name_the_missing_ones() -> None:
    from inference.models.families import family_named
    from skyrl_train.workers.megatron.hf_tables import FusedParts, fuse_qkv, fused_entries

    arch = TinyMoEConfig().architecture()
    parts = FusedParts(fused_entries(arch, family_named(arch.family)))
    qkv = "self_attention.linear_qkv.weight"
    rows = parts.entries[qkv].part_rows(torch.empty(0))
    q, k, v = (torch.randn(r, arch.hidden_size) for r in rows)
    assert parts.add(1, qkv, 2, v) is None and parts.add(1, qkv, 0, q) is None
    whole = parts.add(1, qkv, 1, k)
    assert whole is not None and torch.equal(whole, fuse_qkv(q, k, v, arch))
    parts.check_complete()
    assert parts.add(2, qkv, 1, k) is None
    with pytest.raises(
        ValueError,
        match=r"^model.layers.2: expected all of \['self_attn.q_proj.weight', "
        r"'self_attn.k_proj.weight', 'self_attn.v_proj.weight'\] \(fused into "
        r"self_attention.linear_qkv.weight\), got only \['self_attn.k_proj.weight'\]$",
    ):
        parts.check_complete()


def _engine_rollout(case: Case):
    """fp32 engine generations with routes, as a TrainingBatch (no padding anywhere:
    equal prompt and response lengths)."""
    engine = HFMoEEngine.from_pretrained(case.folder, dtype="float32", batch_invariant=False)
    try:
        requests = [
            EngineRequest(
                p,
                SamplingParams(max_tokens=GENERATED, seed=i, ignore_eos=True),
                return_routed_experts=True,
            )
            for i, p in enumerate(PROMPTS)
        ]
        outputs = engine.generate_sync(requests)
    finally:
        engine._executor.shutdown(wait=True)
        engine.capture.remove()
    routes = [np.asarray(o.routed_experts).astype(np.int64) for o in outputs]
    assert routes[0].shape == (len(PROMPTS[0]) + GENERATED - 1, case.arch.num_moe_layers, 3)
    return make_batch(
        PROMPTS,
        [o.token_ids for o in outputs],
        num_layers=case.arch.num_moe_layers,
        top_k=case.arch.num_experts_per_tok,
        routes=routes,
    )


def test_engine_routes_equal_megatron_record_and_replay_agrees(case: Case) -> None:
    batch = _engine_rollout(case)
    real = ~batch.router_padding_mask  # every token but the last, never fed
    assert batch.routed_experts is not None
    engine_sets = batch.routed_experts.sort(-1).values

    recorded = record_routes(case.worker, batch)
    assert recorded.shape == batch.routed_experts.shape  # [B, S, L_moe, K]
    assert torch.equal(recorded.sort(-1).values[real], engine_sets[real])

    replayed = case.worker.forward(batch, replay_routes=True, capture_routes=True).routes
    assert replayed is not None
    assert torch.equal(replayed[real], engine_sets[real])
    assert router_agreement(case.worker, batch, replay_routes=True) == 1.0


def test_replay_puts_each_route_layer_into_its_own_moe_layer(case: Case) -> None:
    """Random routes (unlike the model's own) dispatch exactly as given: with a dense
    first layer, route layer 0 must reach decoder layer 1."""
    plain = _engine_rollout(case)
    seq = plain.sequences.shape[1]
    forced = random_routes(3, seq, case.arch.num_moe_layers, 6, 3, seed=4)
    batch = make_batch(
        PROMPTS,
        plain.sequences[:, len(PROMPTS[0]) :].tolist(),
        num_layers=case.arch.num_moe_layers,
        top_k=3,
        routes=[forced[b, : seq - 1] for b in range(3)],
    )
    assert batch.routed_experts is not None
    real = ~batch.router_padding_mask
    want = batch.routed_experts.sort(-1).values
    natural = case.worker.forward(batch, replay_routes=False, capture_routes=True).routes
    replayed = case.worker.forward(batch, replay_routes=True, capture_routes=True).routes
    assert natural is not None and replayed is not None
    assert (natural[real] != want[real]).any(-1).float().mean() > 0.5
    assert torch.equal(replayed[real], want[real])


def test_routes_with_the_wrong_layer_count_are_refused(case: Case) -> None:
    arch = case.arch
    # Dense-first families: what an engine capturing every decoder layer would send.
    wrong = arch.num_layers if arch.dense_layers else arch.num_moe_layers - 1
    seq = len(PROMPTS[0]) + 2
    routes = random_routes(3, seq, wrong, 6, 3, seed=1)
    batch = make_batch(
        PROMPTS, [[50, 51]] * 3, num_layers=wrong, top_k=3, routes=list(routes[:, : seq - 1])
    )
    with pytest.raises(
        RouteReplayError,
        match=rf"^routed_experts: expected {arch.num_moe_layers} MoE layers x top-3 "
        rf"\(the model's\), got {wrong} layers x top-3$",
    ):
        case.worker.forward(batch, replay_routes=True)


def test_the_builtin_model_builds_as_it_did_from_one_local_spec() -> None:
    """The per-layer specs give the built-in model (every layer MoE) the very module
    tree, names and seeded initial weights the single local layer spec gave."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from skyrl_train.workers.megatron.model import build_model_chunks, build_transformer_config

    cfg = TinyMoEConfig()
    arch = cfg.architecture()
    mc = MegatronConfig()
    worker = MegatronPolicyWorker(arch, mc, routing_replay=False).setup()  # parallel state
    config = build_transformer_config(arch, mc, routing_replay=False)
    (chunk,) = build_model_chunks(arch, config, seed=3)
    built = chunk.state_dict()
    torch.manual_seed(3)
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    before = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=cfg.rope_theta,
    ).state_dict()
    assert list(built) == list(before)
    tensors = [n for n in before if isinstance(before[n], torch.Tensor)]
    assert tensors and all(torch.equal(built[n], before[n]) for n in tensors)
    assert worker.routers is not None and worker.routers.moe_layers == (0, 1, 2, 3)
