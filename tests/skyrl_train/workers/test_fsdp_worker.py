"""The FSDP2 worker against the Megatron worker on the built-in model: same checkpoint
folder, same weights, same batch (left and right padding, three microbatches, random
rollout routes), fp32. R3 log-probs, captured routes, loss, gradients, grad norm and
the weights after one AdamW step agree (issue 40's differential targets); so do the
sampler-replay and entropy scores. Two FSDP ranks on gloo equal one rank on the same
global batch."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _fsdp_pairs import build_fsdp, build_pair, layout_batch
from _fsdp_pairs import policy_loss as _loss
from _fsdp_pairs import worst as _close
from _megatron_batches import PAD_ID
from _ranks import run_group
from _step_checks import clipped_grads, steady_worst

from inference.models.checkpoint import builtin_checkpoint
from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.schema import FSDPConfig, OptimizerConfig
from skyrl_train.dataset.batch import TrainingBatch, slice_batch
from skyrl_train.errors import RouteReplayError
from skyrl_train.trainer.policy import checkpoint_weights
from skyrl_train.workers.microbatches import MicrobatchPlan, row_tokens

CFG = TinyMoEConfig()
ARCH = CFG.architecture()
OPT = OptimizerConfig(lr=1e-2, max_grad_norm=1.0)
TOL = 1e-5
MICRO = 2  # five rows: three microbatches, the last one shorter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builtin_checkpoint(CFG, seed=3, cache_dir=tmp_path_factory.mktemp("builtin"))


@pytest.fixture(scope="module")
def hf_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    return dict(checkpoint_weights(checkpoint))


@pytest.fixture(scope="module")
def pair(checkpoint: Path) -> tuple:
    torch.set_num_threads(1)
    return build_pair(checkpoint, ARCH, optimizer=OPT, pad_token_id=PAD_ID)


@pytest.fixture
def fresh(pair: tuple, hf_state: dict[str, torch.Tensor]) -> tuple:
    """Both workers back on the checkpoint's weights."""
    for worker in pair:
        worker.load_weights(hf_state.items())
    return pair


def test_export_names_are_the_megatron_workers_hf_names(fresh) -> None:
    megatron, fsdp = fresh
    names = [name for name, _ in fsdp.export_weights()]
    # The same tensors under the same names; the order is each model's own.
    assert sorted(names) == sorted(name for name, _ in megatron.export_weights())
    assert len(set(names)) == len(names)
    assert fsdp.mesh.size() == 1  # one rank, through fully_shard's code path
    info = fsdp.rank_info()
    assert (info.dp_size, info.ep_size, info.tp_size, info.pp_size) == (1, 1, 1, 1)


@pytest.mark.parametrize("replay", [False, True])
def test_forward_logprobs_and_routes_match_megatron(fresh, replay: bool) -> None:
    megatron, fsdp = fresh
    batch = layout_batch(ARCH, vocab=CFG.vocab_size)
    want = megatron.forward(
        batch, micro_batch_size=MICRO, replay_routes=replay, capture_routes=True
    )
    got = fsdp.forward(batch, micro_batch_size=MICRO, replay_routes=replay, capture_routes=True)
    assert _close(got.logprobs, want.logprobs) <= TOL
    assert torch.all(got.logprobs[batch.response_mask == 0] == 0)
    assert got.routes is not None and torch.equal(got.routes, want.routes)
    agreement = fsdp.rollout_router_agreement(batch, got.routes)
    # Replayed: the gates dispatched the rollout's ids; native: random routes disagree.
    assert (agreement.agreement == 1.0) == replay
    # The rollout dumps' per-token form says the same, on both backends, and counts
    # only the positions the agreement compares.
    for worker, routes in ((fsdp, got.routes), (megatron, want.routes)):
        flips = worker.rollout_router_flips(batch, routes)
        assert flips.shape == routes.shape[:3] and flips.dtype == torch.bool
        compared = agreement.num_token_layers
        assert 1.0 - flips.sum().item() / compared == pytest.approx(agreement.agreement)
        assert not flips[~batch.attention_mask.bool()].any()
        assert flips.any().item() != replay


def test_sampler_replay_temperature_and_entropy_match_megatron(fresh) -> None:
    megatron, fsdp = fresh
    batch = layout_batch(ARCH, vocab=CFG.vocab_size, seed=4)
    gen = torch.Generator().manual_seed(5)
    rows, actions = batch.response_mask.shape
    response = batch.sequences[:, -actions:]
    others = torch.randint(0, CFG.vocab_size, (rows, actions, 5), generator=gen)
    support = torch.cat([response[..., None], others], dim=-1)
    support[0, :, 3:] = -1  # a shorter kept set
    support[1] = -1  # a row that lists none keeps the whole vocabulary
    batch.sample_support = support
    want = megatron.forward(batch, micro_batch_size=MICRO, entropy=True, temperature=0.7)
    got = fsdp.forward(batch, micro_batch_size=MICRO, entropy=True, temperature=0.7)
    assert got.entropy is not None and want.entropy is not None
    assert _close(got.logprobs, want.logprobs) <= TOL
    assert _close(got.entropy, want.entropy) <= TOL
    plain = fsdp.forward(batch, micro_batch_size=MICRO, temperature=1.0)
    assert _close(plain.logprobs, got.logprobs) > 1e-2  # the sampler changed the scores


def test_r3_train_step_matches_megatron(fresh, hf_state) -> None:
    megatron, fsdp = fresh
    batch = layout_batch(ARCH, vocab=CFG.vocab_size, seed=6)
    kwargs = dict(loss_fn=_loss, micro_batch_size=MICRO, entropy=True, capture_routes=True)
    want = megatron.train_step(batch, **kwargs)
    got = fsdp.train_step(batch, **kwargs)
    assert got.replayed and want.replayed and got.num_microbatches == 3
    assert got.routes is not None and torch.equal(got.routes, want.routes)
    assert abs(got.loss - want.loss) <= 1e-6, (got.loss, want.loss)
    assert abs(got.grad_norm - want.grad_norm) <= TOL * want.grad_norm
    assert want.grad_norm > OPT.max_grad_norm  # the clip acted
    assert got.lr == want.lr
    want_grads, got_grads = clipped_grads(megatron), clipped_grads(fsdp)
    assert max(_close(got_grads[n], want_grads[n]) for n in want_grads) <= TOL
    want_w, got_w = dict(megatron.export_weights()), dict(fsdp.export_weights())
    assert max(_close(want_w[n], hf_state[n]) for n in hf_state) > 1e-3  # the step moved them
    assert steady_worst(got_w, want_w, want_grads) <= TOL


def test_checkpoint_state_round_trips_and_swapped_weights_restore(fresh, hf_state) -> None:
    _, fsdp = fresh
    batch = layout_batch(ARCH, vocab=CFG.vocab_size, seed=7)
    fsdp.train_step(batch, loss_fn=_loss, micro_batch_size=MICRO, entropy=True)
    saved = {k: _clone(v) for k, v in fsdp.checkpoint_state().items()}
    before = dict(fsdp.export_weights())
    step = fsdp.train_step(batch, loss_fn=_loss, micro_batch_size=MICRO, entropy=True)
    fsdp.load_checkpoint_state(saved)
    assert all(torch.equal(w, before[n]) for n, w in fsdp.export_weights())
    again = fsdp.train_step(batch, loss_fn=_loss, micro_batch_size=MICRO, entropy=True)
    assert (again.loss, again.grad_norm, again.lr) == (step.loss, step.grad_norm, step.lr)
    # The reference policy's weights inside the block, the policy's own after it.
    reference = {n: p.detach().clone() for n, p in fsdp.named_parameters()}
    fsdp.load_weights(hf_state.items())
    policy = fsdp.forward(batch, micro_batch_size=MICRO).logprobs
    with fsdp.swapped_weights(reference):
        assert _close(fsdp.forward(batch, micro_batch_size=MICRO).logprobs, policy) > 1e-3
    assert torch.equal(fsdp.forward(batch, micro_batch_size=MICRO).logprobs, policy)


def test_activation_checkpointing_and_gathered_layers_change_nothing(
    fresh, checkpoint, hf_state
) -> None:
    """``fsdp_config``'s memory keys: a recomputed layer replays the same ids and is
    not captured twice, a layer kept gathered after a forward still sees weights
    written after it, and the fused attention kernel takes the same step."""
    _, fsdp = fresh
    config = FSDPConfig(
        activation_checkpointing=True, reshard_after_forward=False, attn_implementation="sdpa"
    )
    other = build_fsdp(checkpoint, ARCH, optimizer=OPT, pad_token_id=PAD_ID, fsdp_config=config)
    assert (fsdp.model.config._attn_implementation, other.model.config._attn_implementation) == (
        "eager",
        "sdpa",
    )
    batch = layout_batch(ARCH, vocab=CFG.vocab_size, seed=9)
    # Other weights through a forward (which gathers the layers and keeps them), then
    # the checkpoint's: the second load must reach the shards the step updates.
    other.load_weights((n, t * 1.01) for n, t in hf_state.items())
    other.forward(batch, micro_batch_size=MICRO)
    other.load_weights(hf_state.items())
    own = other.forward(batch, micro_batch_size=MICRO).logprobs
    moved = {n: p.detach() * 1.01 for n, p in other.named_parameters()}
    with other.swapped_weights(moved):
        assert _close(other.forward(batch, micro_batch_size=MICRO).logprobs, own) > 1e-4
    assert torch.equal(other.forward(batch, micro_batch_size=MICRO).logprobs, own)
    kwargs = dict(loss_fn=_loss, micro_batch_size=MICRO, entropy=True, capture_routes=True)
    want = fsdp.train_step(batch, **kwargs)
    got = other.train_step(batch, **kwargs)
    assert got.routes is not None and torch.equal(got.routes, want.routes)
    assert abs(got.loss - want.loss) <= 1e-6
    assert abs(got.grad_norm - want.grad_norm) <= TOL * want.grad_norm
    want_grads, got_grads = clipped_grads(fsdp), clipped_grads(other)
    assert max(_close(got_grads[n], want_grads[n]) for n in want_grads) <= TOL


def test_bf16_compute_keeps_fp32_weights_and_optimizer(fresh, checkpoint) -> None:
    """``param_dtype: bfloat16``: layers compute in bf16 (log-probs off the fp32 ones by
    bf16 rounding, not equal), the weights, gradients and AdamW stay fp32."""
    _, fsdp = fresh
    config = FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32")
    bf16 = build_fsdp(checkpoint, ARCH, optimizer=OPT, pad_token_id=PAD_ID, fsdp_config=config)
    batch = layout_batch(ARCH, vocab=CFG.vocab_size, seed=10)
    want = fsdp.forward(batch, micro_batch_size=MICRO, replay_routes=True).logprobs
    got = bf16.forward(batch, micro_batch_size=MICRO, replay_routes=True).logprobs
    assert got.dtype == torch.float32
    assert 1e-4 < _close(got, want) < 0.5
    step = bf16.train_step(batch, loss_fn=_loss, micro_batch_size=MICRO, entropy=True)
    assert math.isfinite(step.grad_norm) and step.grad_norm > 0
    assert all(p.dtype == torch.float32 for _, p in bf16.named_parameters())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for _, p in bf16.named_parameters())


def _clone(value):
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def test_bad_input_is_refused_naming_it(fresh, checkpoint, hf_state) -> None:
    _, fsdp = fresh
    batch = layout_batch(ARCH, vocab=CFG.vocab_size)
    with pytest.raises(ValueError, match=r"micro_batch_size: expected a positive int, got 0"):
        fsdp.forward(batch, micro_batch_size=0)
    with pytest.raises(
        ValueError, match=r"model.layers.9.mlp.gate.weight: expected a Qwen3MoeForCausalLM weight"
    ):
        fsdp.load_weights([("model.layers.9.mlp.gate.weight", torch.zeros(8, 64))])
    with pytest.raises(ValueError, match=r"model.norm.weight.shape: expected \(64,\), got \(3,\)"):
        fsdp.load_weights([("model.norm.weight", torch.zeros(3))])
    off = build_fsdp(checkpoint, ARCH, optimizer=OPT, pad_token_id=PAD_ID, routing_replay=False)
    with pytest.raises(RouteReplayError, match=r"trainer.policy.routing_replay.enabled"):
        off.forward(batch, replay_routes=True)
    assert off.forward(batch, capture_routes=True).routes is not None  # native routing runs
    bad = layout_batch(ARCH, vocab=CFG.vocab_size)
    assert bad.routed_experts is not None
    bad.routed_experts[0, -1, 0, 0] = CFG.num_experts
    with pytest.raises(RouteReplayError):
        fsdp.forward(bad, replay_routes=True)
    # A reference snapshot short of one parameter, or of another shape: refused before
    # anything is written, the model's own weights kept.
    before = fsdp.forward(batch).logprobs
    snapshot = fsdp.parameter_snapshot()
    short = {n: t for n, t in snapshot.items() if n != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        with fsdp.swapped_weights(short):
            pass
    odd = {**snapshot, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"weights\['model.norm.weight'\]: expected shape"):
        with fsdp.swapped_weights(odd):
            pass
    assert torch.equal(fsdp.forward(batch).logprobs, before)


# ---- two data-parallel ranks --------------------------------------------------------

WORLD = 2


def _dp_batch() -> TrainingBatch:
    return layout_batch(ARCH, vocab=CFG.vocab_size, seed=8, rows=4)


DP_STEP = dict(loss_fn=_loss, micro_batch_size=1, entropy=True)


def _rank_main(rank: int, checkpoint: str, reference: str) -> None:
    want = torch.load(reference)
    batch = _dp_batch()
    # The memory keys off their defaults: the sums must not depend on them.
    config = FSDPConfig(activation_checkpointing=True, reshard_after_forward=False)
    worker = build_fsdp(
        Path(checkpoint), ARCH, optimizer=OPT, pad_token_id=PAD_ID, fsdp_config=config
    )
    assert worker.mesh.size() == WORLD and worker.rank_info().dp_size == WORLD
    shard = slice_batch(batch, 2 * rank, 2 * rank + 2)
    lp = worker.forward(shard, micro_batch_size=1).logprobs
    assert _close(lp, want["logprobs"][2 * rank : 2 * rank + 2]) <= TOL
    # Layers kept gathered after that forward must still see weights written to
    # their shards after it (the reference policy's swap).
    moved = {n: p.detach() * 1.01 for n, p in worker.named_parameters()}
    with worker.swapped_weights(moved):
        assert _close(worker.forward(shard, micro_batch_size=1).logprobs, lp) > 1e-4
    assert torch.equal(worker.forward(shard, micro_batch_size=1).logprobs, lp)
    got = worker.train_step(shard, **DP_STEP)
    mean_loss = torch.tensor(got.loss, dtype=torch.float64)
    torch.distributed.all_reduce(mean_loss)
    assert abs(float(mean_loss) / WORLD - want["loss"]) <= 1e-6
    assert abs(got.grad_norm - want["grad_norm"]) <= TOL * want["grad_norm"]
    grads, weights = clipped_grads(worker), dict(worker.export_weights())
    assert max(_close(grads[n], want["grads"][n]) for n in grads) <= TOL
    assert steady_worst(weights, want["weights"], want["grads"]) <= TOL
    # Unequal shards would hang the first all-gather: refused on both ranks.
    with pytest.raises(ValueError, match=r"same number of microbatches .* got 1 to 2"):
        worker.forward(slice_batch(batch, 0, 2 - rank), micro_batch_size=1)
    _packed_rank(rank, Path(checkpoint), batch, shard, want, config)


def _packed_rank(
    rank: int,
    checkpoint: Path,
    batch: TrainingBatch,
    shard: TrainingBatch,
    want: dict,
    config: FSDPConfig,
) -> None:
    """Packed rows (issue 52) under a token budget that fits rank 0's two rows in one
    microbatch but not rank 1's: the ranks agree on the larger count (2, one row each),
    and the step equals the padded one-rank reference."""
    budget = sum(row_tokens(batch.attention_mask[:2]))
    lengths = row_tokens(shard.attention_mask)
    count = torch.tensor(MicrobatchPlan.by_tokens(lengths, max_tokens=budget).count)
    assert int(count) == 1 + rank
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    plan = MicrobatchPlan.by_tokens(lengths, max_tokens=budget, count=int(count))
    worker = build_fsdp(
        checkpoint,
        ARCH,
        optimizer=OPT,
        pad_token_id=PAD_ID,
        fsdp_config=config,
        remove_microbatch_padding=True,
    )
    lp = worker.forward(shard, micro_batch_size=plan).logprobs
    assert _close(lp, want["logprobs"][2 * rank : 2 * rank + 2]) <= TOL
    got = worker.train_step(shard, **{**DP_STEP, "micro_batch_size": plan})
    assert got.num_microbatches == 2
    mean_loss = torch.tensor(got.loss, dtype=torch.float64)
    torch.distributed.all_reduce(mean_loss)
    assert abs(float(mean_loss) / WORLD - want["loss"]) <= 1e-6
    assert abs(got.grad_norm - want["grad_norm"]) <= TOL * want["grad_norm"]
    assert steady_worst(dict(worker.export_weights()), want["weights"], want["grads"]) <= TOL


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_data_parallel_ranks_equal_one_rank(checkpoint, tmp_path) -> None:
    # The one-rank reference here, on this process's one-rank group; 4 rows, one per
    # microbatch, against 2 ranks of 2.
    ref = build_fsdp(checkpoint, ARCH, optimizer=OPT, pad_token_id=PAD_ID)
    batch = _dp_batch()
    logprobs = ref.forward(batch, micro_batch_size=1).logprobs
    step = ref.train_step(batch, **DP_STEP)
    want = {
        "logprobs": logprobs,
        "loss": step.loss,
        "grad_norm": step.grad_norm,
        "grads": clipped_grads(ref),
        "weights": dict(ref.export_weights()),
    }
    torch.save(want, tmp_path / "reference.pt")
    run_group(
        _rank_main,
        args=(str(checkpoint), str(tmp_path / "reference.pt")),
        nprocs=WORLD,
        rendezvous=tmp_path / "rendezvous",
    )


def test_the_fsdp_backend_never_imports_megatron(checkpoint) -> None:
    """An FSDP user may not have megatron-core working: building the worker, loading
    weights, a forward and a train step load no ``megatron`` module (a fresh
    interpreter, which the worker joins to a world of one itself)."""
    script = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from _fsdp_pairs import build_fsdp, layout_batch
from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.schema import OptimizerConfig
cfg = TinyMoEConfig()
arch = cfg.architecture()
worker = build_fsdp({str(checkpoint)!r}, arch, optimizer=OptimizerConfig(), pad_token_id=256)
batch = layout_batch(arch, vocab=cfg.vocab_size)
worker.forward(batch, micro_batch_size=2, capture_routes=True)
worker.train_step(batch, loss_fn=lambda lp, mb: lp.sum(), micro_batch_size=2)
print(sorted(m for m in sys.modules if "megatron" in m.split(".")))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
