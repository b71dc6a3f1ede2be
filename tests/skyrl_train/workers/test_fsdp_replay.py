"""Routing replay in transformers' MoE blocks (skyrl_train/workers/fsdp/replay.py), on
the four families' tiny models and the built-in model, fp32: replaying a model's own
routes changes no bit, replayed ids are what the experts receive (seen by hooks of the
test's own on the experts, not by the replay's recorder), the router's gradient is the
hand formula's, a checkpoint recompute replays the same ids, and bad routes are refused."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _megatron_batches import random_routes
from _ranks import one_rank_group
from transformers import AutoModelForCausalLM

from inference.errors import CheckpointFormatError
from inference.models.architecture import MoEArchitecture, TinySizes
from inference.models.families import FAMILIES
from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from skyrl_train.errors import RouteReplayError
from skyrl_train.workers.fsdp.replay import GateReplay
from skyrl_train.workers.routes import validate_routes

BATCH, SEQ = 2, 7
MODELS = [*FAMILIES, "builtin"]


@dataclasses.dataclass
class Setup:
    model: Any
    arch: MoEArchitecture
    replay: GateReplay
    tokens: torch.Tensor
    plain_logits: torch.Tensor
    """transformers' own blocks, before any hook was installed."""


def _build(name: str) -> tuple[Any, MoEArchitecture]:
    if name == "builtin":
        config = TinyMoEConfig()
        return build_hf_model(config, seed=0), config.architecture()
    family = FAMILIES[name]
    hf_config = family.tiny_config(TinySizes())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    return model, family.describe(hf_config)


@pytest.fixture(scope="module", params=MODELS)
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    model, arch = _build(request.param)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=gen)
    with torch.no_grad():
        plain = model(tokens).logits
    replay = GateReplay(model, arch)
    yield Setup(model, arch, replay, tokens, plain)
    replay.close()


def _random(arch: MoEArchitecture, seed: int = 2) -> torch.Tensor:
    return random_routes(
        BATCH, SEQ, arch.num_moe_layers, arch.num_experts, arch.num_experts_per_tok, seed=seed
    )


def _experts(model: Any, arch: MoEArchitecture) -> list[torch.nn.Module]:
    return [model.model.layers[i].mlp.experts for i in arch.moe_layers]


class ExpertInputs:
    """The top-k ids each MoE layer's experts module is called with: the dispatch the
    block really made, observed without the replay's own hooks or recorder."""

    def __init__(self, model: Any, arch: MoEArchitecture) -> None:
        self.calls: list[list[torch.Tensor]] = [[] for _ in arch.moe_layers]
        self._handles = [
            experts.register_forward_pre_hook(self._hook(i))
            for i, experts in enumerate(_experts(model, arch))
        ]

    def _hook(self, index: int) -> Any:
        def hook(_module: torch.nn.Module, args: Any) -> None:
            self.calls[index].append(args[1].detach().sort(dim=-1).values)

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def assert_replayed(setup: Setup, routes: torch.Tensor) -> torch.Tensor:
    """Run one replayed forward and check that every MoE layer's experts got exactly
    ``routes`` and that the recorder says so; returns the logits."""
    seen = ExpertInputs(setup.model, setup.arch)
    try:
        with torch.no_grad(), setup.replay.session(routes=routes, capture=True) as recorder:
            logits = setup.model(setup.tokens).logits
    finally:
        seen.close()
    expected = routes.sort(dim=-1).values
    for index, calls in enumerate(seen.calls):
        assert len(calls) == 1, setup.replay.describe_layer(index)
        got = calls[0].view(BATCH, SEQ, -1)
        assert torch.equal(got, expected[:, :, index]), (
            f"{setup.replay.describe_layer(index)}: the experts got other ids than replayed"
        )
    assert torch.equal(recorder.routes(), expected)
    return logits


def test_own_routes_replay_bit_identical_to_native_and_to_plain_blocks(setup: Setup) -> None:
    with torch.no_grad():
        outside = setup.model(setup.tokens).logits  # hooks installed, no session
        with setup.replay.session(routes=None, capture=True) as recorder:
            native = setup.model(setup.tokens).logits
    own = recorder.routes()
    assert own.shape == (BATCH, SEQ, setup.arch.num_moe_layers, setup.arch.num_experts_per_tok)
    assert torch.equal(outside, setup.plain_logits)
    assert torch.equal(native, setup.plain_logits)
    replayed = assert_replayed(setup, own)
    assert torch.equal(replayed, setup.plain_logits)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_own_routes_replay_bit_identical(name: str) -> None:
    """The replayed weights take the router's own output dtype: bf16 for the Qwen
    families and OLMoE, fp32 for Mixtral (its router does not cast back)."""
    model, arch = _build(name)
    model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, arch.vocab_size, (4, 33), generator=gen)
    replay = GateReplay(model, arch)
    try:
        with torch.no_grad(), replay.session(routes=None, capture=True) as recorder:
            native = model(tokens).logits
        with torch.no_grad(), replay.session(routes=recorder.routes(), capture=False):
            replayed = model(tokens).logits
    finally:
        replay.close()
    assert native.dtype == torch.bfloat16
    assert torch.equal(replayed, native)


def test_random_routes_are_dispatched_and_change_logits(setup: Setup) -> None:
    routes = _random(setup.arch)
    logits = assert_replayed(setup, routes)
    assert (logits - setup.plain_logits).abs().max() > 1e-2


def test_check_detects_a_missing_hook(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails when one family's hook is not installed."""
    install = GateReplay._install

    def skip_second(self: GateReplay, index: int, *args: Any) -> None:
        if index != 1:
            install(self, index, *args)

    monkeypatch.setattr(GateReplay, "_install", skip_second)
    broken = Setup(
        setup.model,
        setup.arch,
        GateReplay(setup.model, setup.arch),
        setup.tokens,
        setup.plain_logits,
    )
    try:
        with pytest.raises(AssertionError, match="got other ids than replayed"):
            assert_replayed(broken, _random(setup.arch))
        with pytest.raises(RouteReplayError, match="no call"):
            with broken.replay.session(routes=None, capture=True) as recorder:
                with torch.no_grad():
                    setup.model(setup.tokens)
            recorder.routes()
    finally:
        broken.replay.close()


def _gate(setup: Setup, index: int) -> torch.nn.Module:
    return setup.model.model.layers[setup.arch.moe_layers[index]].mlp.gate


def test_router_gradient_under_replay_is_the_hand_formulas(setup: Setup) -> None:
    arch, model = setup.arch, setup.model
    routes = _random(arch)
    last = arch.num_moe_layers - 1
    seen: dict[str, torch.Tensor] = {}

    def grab(_module: Any, inputs: Any, output: Any) -> None:  # after the replay's hook
        seen["hidden"], seen["weights"], seen["ids"] = inputs[0], output[1], output[2]

    handle = _gate(setup, last).register_forward_hook(grab)
    model.zero_grad(set_to_none=True)
    try:
        with setup.replay.session(routes=routes, capture=False):
            logits = model(setup.tokens).logits
            logits.float().logsumexp(-1).mean().backward(retain_graph=True)
            for index in range(arch.num_moe_layers):
                grad = _gate(setup, index).weight.grad
                assert grad is not None and grad.abs().sum() > 0, index
            gen = torch.Generator().manual_seed(3)
            coef = torch.randn(BATCH * SEQ, arch.num_experts, generator=gen)
            probe = (seen["weights"] * coef.gather(1, seen["ids"])).sum()
            (got,) = torch.autograd.grad(probe, _gate(setup, last).weight)
    finally:
        handle.remove()
    weight = _gate(setup, last).weight.detach().clone().requires_grad_(True)
    ids = routes[:, :, last].reshape(BATCH * SEQ, -1)
    probs = torch.softmax((seen["hidden"].detach() @ weight.T).float(), dim=-1)
    picked = probs.gather(1, ids)
    if arch.norm_topk_prob:
        picked = picked / picked.sum(-1, keepdim=True)
    (want,) = torch.autograd.grad((picked * coef.gather(1, ids)).sum(), weight)
    assert got.abs().sum() > 0
    # fp32: the hand formula sums the K weights in the routes' order, the replay in the
    # router's (descending); Mixtral measured 4e-6 relative on one element.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    model.zero_grad(set_to_none=True)


def test_checkpoint_recompute_replays_the_same_ids_and_records_once(setup: Setup) -> None:
    model, arch = setup.model, setup.arch
    routes = _random(arch, seed=4)

    def grads(checkpointing: bool) -> tuple[dict[str, torch.Tensor], ExpertInputs, Any]:
        if checkpointing:
            model.activation_checkpointing_enable()
        model.train()
        model.zero_grad(set_to_none=True)
        seen = ExpertInputs(model, arch)
        try:
            with setup.replay.session(routes=routes, capture=True) as recorder:
                model(setup.tokens).logits.float().logsumexp(-1).mean().backward()
        finally:
            seen.close()
            model.eval()
            model.activation_checkpointing_disable()
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out, seen, recorder

    plain, _, _ = grads(False)
    recomputed, seen, recorder = grads(True)
    assert recorder.gate_calls == (2,) * arch.num_moe_layers  # forward + recompute
    expected = routes.sort(dim=-1).values
    for index, calls in enumerate(seen.calls):
        assert len(calls) == 2
        for ids in calls:
            assert torch.equal(ids.view(BATCH, SEQ, -1), expected[:, :, index])
    assert torch.equal(recorder.routes(), expected)
    assert plain.keys() == recomputed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0, msg=name)


def test_capture_records_the_forward_not_the_recompute(setup: Setup) -> None:
    """Native routing under checkpointing, with the routers negated between forward and
    backward: the recompute routes elsewhere, and the recorder keeps the forward's."""
    model, arch = setup.model, setup.arch
    with torch.no_grad(), setup.replay.session(routes=None, capture=True) as recorder:
        model(setup.tokens)
    forward_routes = recorder.routes()
    gates = [_gate(setup, i) for i in range(arch.num_moe_layers)]
    model.activation_checkpointing_enable()
    model.train()
    seen = ExpertInputs(model, arch)
    try:
        with setup.replay.session(routes=None, capture=True) as recorder:
            loss = model(setup.tokens, use_cache=False).logits.logsumexp(-1).mean()
            with torch.no_grad():
                for gate in gates:
                    gate.weight.neg_()
            loss.backward()
    finally:
        with torch.no_grad():
            for gate in gates:
                gate.weight.neg_()
        seen.close()
        model.eval()
        model.activation_checkpointing_disable()
        model.zero_grad(set_to_none=True)
    assert recorder.gate_calls == (2,) * arch.num_moe_layers
    assert any(not torch.equal(first, again) for first, again in seen.calls)
    assert torch.equal(recorder.routes(), forward_routes)


@pytest.mark.parametrize("name", MODELS)
def test_hooks_survive_fully_shard_and_checkpointing(name: str) -> None:
    """Hooks installed on the plain model still replay after ``fully_shard`` of every
    decoder layer and the root (one gloo rank) with activation checkpointing: the same
    gradients bit for bit, every router called by the forward and the recompute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, arch = _build(name)
    model.train()
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ), generator=torch.Generator())
    routes = _random(arch, seed=5)
    replay = GateReplay(model, arch)

    def grads() -> tuple[dict[str, torch.Tensor], Any]:
        with replay.session(routes=routes, capture=True) as recorder:
            model(tokens, use_cache=False).logits.logsumexp(-1).mean().backward()
        out = {n: _full(p.grad) for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out, recorder

    try:
        with one_rank_group():
            plain, _ = grads()
            mesh = init_device_mesh("cpu", (1,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.activation_checkpointing_enable()
            sharded, recorder = grads()
    finally:
        replay.close()
    assert type(model).__name__.startswith("FSDP")
    assert recorder.gate_calls == (2,) * arch.num_moe_layers
    assert torch.equal(recorder.routes(), routes.sort(dim=-1).values)
    assert plain.keys() == sharded.keys()
    for key, grad in plain.items():
        assert torch.equal(sharded[key], grad), key


def _full(tensor: Any) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def test_second_forward_in_one_session_is_refused(setup: Setup) -> None:
    with torch.no_grad(), setup.replay.session(routes=None, capture=True):
        setup.model(setup.tokens)
        with pytest.raises(RouteReplayError, match="one forward per session"):
            setup.model(setup.tokens)


def test_routes_for_other_tokens_are_refused_naming_the_layer(setup: Setup) -> None:
    routes = _random(setup.arch)[:, :-1]  # one position short
    first = setup.replay.describe_layer(0)
    with pytest.raises(
        RouteReplayError,
        match=rf"replayed routes, {re.escape(first)}: expected the routes' 2 x 6 = 12 tokens"
        r" at the router, got 14 tokens \(2 x 7\)",
    ):
        with torch.no_grad(), setup.replay.session(routes=routes, capture=False):
            setup.model(setup.tokens)


@pytest.mark.parametrize(
    ("edit", "row", "message"),
    [
        (lambda r: r[:, :, :-1], None, r"^routed_experts: expected \d MoE layers x top-K"),
        (lambda r: r[..., :-1], None, r"^routed_experts: expected \d MoE layers x top-K"),
        (lambda r: _set(r, (1, 4, 0, 0), 99), 1, r", LAYER, token 4: expected expert ids"),
        (lambda r: _set(r, (0, 3, 0, 1), int(r[0, 3, 0, 0])), 0, r", LAYER, token 3: expected"),
    ],
    ids=["layers", "top_k", "out_of_range", "duplicate"],
)
def test_bad_routes_are_refused_before_any_forward(
    setup: Setup, edit: Any, row: int | None, message: str
) -> None:
    message = message.replace("top-K", f"top-{setup.arch.num_experts_per_tok}")
    message = message.replace("LAYER", re.escape(setup.replay.describe_layer(0)))
    bad = edit(_random(setup.arch))
    seen = ExpertInputs(setup.model, setup.arch)
    where = "" if row is None else rf"^batch row {row}"
    try:
        with pytest.raises(RouteReplayError, match=where + message):
            with setup.replay.session(routes=bad, capture=False):
                setup.model(setup.tokens)
    finally:
        seen.close()
    assert all(not calls for calls in seen.calls)
    named = "" if row is None else rf"^trajectory '{'ab'[row]}' \(batch row {row}\)"
    with pytest.raises(RouteReplayError, match=named + message):
        validate_routes(bad, setup.replay, trajectory_ids=["a", "b"])


def _set(routes: torch.Tensor, at: tuple[int, int, int, int], value: int) -> torch.Tensor:
    routes = routes.clone()
    routes[at] = value
    return routes


def test_route_layers_name_the_decoder_layer_where_they_differ() -> None:
    family = FAMILIES["qwen3_moe"]
    hf_config = family.tiny_config(TinySizes())  # a dense first layer
    arch = family.describe(hf_config)
    replay = GateReplay(AutoModelForCausalLM.from_config(hf_config), arch)
    try:
        assert arch.moe_layers == (1, 2)
        assert replay.describe_layer(0) == "MoE layer 0 (decoder layer 1)"
    finally:
        replay.close()


def test_mixtral_router_jitter_is_refused_naming_the_key() -> None:
    family = FAMILIES["mixtral"]
    hf_config = family.tiny_config(TinySizes())
    hf_config.router_jitter_noise = 0.01
    model = AutoModelForCausalLM.from_config(hf_config)
    with pytest.raises(
        CheckpointFormatError, match=r"^config.json:router_jitter_noise: expected 0"
    ):
        GateReplay(model, family.describe(hf_config))


class _PairRouter(torch.nn.Module):
    """A router returning (logits, ids): not the 3-tuple replay needs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = hidden.reshape(-1, 8) @ self.weight.T
        return logits, logits.topk(2).indices


def test_a_router_without_the_three_tuple_is_refused_naming_the_layer() -> None:
    config = TinyMoEConfig()
    model, arch = build_hf_model(config, seed=0), config.architecture()
    layer = model.model.layers[arch.moe_layers[1]]
    layer.mlp.gate = _PairRouter()
    layer.mlp.gate.top_k, layer.mlp.gate.num_experts = 2, 8
    replay = GateReplay(model, arch)
    try:
        with pytest.raises(
            RouteReplayError, match=r"^layer 1: _PairRouter output: expected \(router_logits"
        ):
            with torch.no_grad(), replay.session(routes=None, capture=True):
                model(torch.zeros(1, 3, dtype=torch.int64))
    finally:
        replay.close()


def test_a_router_set_up_unlike_the_architecture_is_refused() -> None:
    config = TinyMoEConfig()
    model, arch = build_hf_model(config, seed=0), config.architecture()
    model.model.layers[2].mlp.gate.norm_topk_prob = False
    with pytest.raises(
        RouteReplayError,
        match=r"^layer 2: Qwen3MoeTopKRouter.norm_topk_prob: expected True \(the arch",
    ):
        GateReplay(model, arch)


def test_sessions_do_not_nest(setup: Setup) -> None:
    with setup.replay.session(routes=None, capture=False):
        with pytest.raises(ValueError, match="expected no open session"):
            with setup.replay.session(routes=None, capture=False):
                pass
