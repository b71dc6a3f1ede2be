"""Packed microbatches on the FSDP worker (issue 52, item 3; ``workers/fsdp/packed.py``):
each microbatch's rows run as one row with positions restarting per row and attention
kept inside each row, routes replayed on the packed tokens.

Against the padded worker on the same batch and weights, fp32, R3 (the issue's
equivalence targets): per-token log-probs within 1e-5, loss within 1e-6, grad norm
within 1e-5 relative, weights after one AdamW step within 1e-5 where the gradient is
at least 1e-6, replay agreement 1.0; on the built-in model and the four checkpoint
families. Then a row boundary that a one-token-wider mask would cross, a plan that
reorders rows, and the refusals.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _fsdp_pairs import build_fsdp, layout_batch
from _fsdp_pairs import policy_loss as _loss
from _fsdp_pairs import worst as _worst
from _megatron_batches import PAD_ID
from _step_checks import clipped_grads, steady_worst

from inference.models.architecture import MoEArchitecture, TinySizes
from inference.models.checkpoint import builtin_checkpoint
from inference.models.families import FAMILIES, describe
from inference.models.tiny_moe import TinyMoEConfig
from skyrl_train.config.schema import FSDPConfig, OptimizerConfig
from skyrl_train.dataset.batch import slice_batch
from skyrl_train.dataset.route_rows import PackedRouteRows
from skyrl_train.trainer.policy import checkpoint_weights
from skyrl_train.workers.fsdp import FSDPPolicyWorker
from skyrl_train.workers.fsdp import packed as packed_attention
from skyrl_train.workers.microbatches import MicrobatchPlan

OPT = OptimizerConfig(lr=1e-2, max_grad_norm=1.0)
TOL = 1e-5
MICRO = 2  # five rows: three packed microbatches, the last one a single row
REORDERED = MicrobatchPlan(((0, 3), (1, 4), (2,)))


class Pair:
    """The padded and the packed FSDP worker on one checkpoint's weights."""

    def __init__(self, name: str, folder: Path, arch: MoEArchitecture, vocab: int) -> None:
        self.name, self.folder, self.arch = name, folder, arch
        self.hf = dict(checkpoint_weights(folder))
        self.padded = build_fsdp(folder, arch, optimizer=OPT, pad_token_id=PAD_ID)
        self.packed = _packed_worker(folder, arch)
        self.batch = layout_batch(arch, vocab=vocab, seed=7)

    def fresh(self) -> Pair:
        for worker in (self.padded, self.packed):
            worker.load_weights(self.hf.items())
        return self


def _packed_worker(
    folder: Path, arch: MoEArchitecture, attention: str = "eager"
) -> FSDPPolicyWorker:
    config = FSDPConfig(attn_implementation=attention)
    return build_fsdp(
        folder,
        arch,
        optimizer=OPT,
        pad_token_id=PAD_ID,
        fsdp_config=config,
        remove_microbatch_padding=True,
    )


def _family_checkpoint(name: str, folder: Path) -> MoEArchitecture:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(FAMILIES[name].tiny_config(TinySizes()))
    model.save_pretrained(str(folder))
    return describe(model.config)


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    torch.set_num_threads(1)
    cfg = TinyMoEConfig()
    folder = builtin_checkpoint(cfg, seed=3, cache_dir=tmp_path_factory.mktemp("builtin"))
    return Pair("builtin", folder, cfg.architecture(), cfg.vocab_size)


@pytest.fixture(scope="module", params=["builtin", *sorted(FAMILIES)])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    if request.param == "builtin":
        return request.getfixturevalue("builtin")
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp(request.param)
    arch = _family_checkpoint(request.param, folder)
    return Pair(request.param, folder, arch, TinySizes().vocab_size)


def test_packed_forward_and_step_match_padded(pair: Pair) -> None:
    pair.fresh()
    padded, packed, batch = pair.padded, pair.packed, pair.batch
    # The packed worker gets the routes as collation hands them over: packed by row.
    rows = PackedRouteRows.from_rectangle(batch.routed_experts, batch.attention_mask)
    as_collated = dataclasses.replace(batch, routed_experts=rows)
    forward = dict(micro_batch_size=MICRO, replay_routes=True, capture_routes=True, entropy=True)
    want, got = padded.forward(batch, **forward), packed.forward(as_collated, **forward)
    assert _worst(got.logprobs, want.logprobs) <= TOL, pair.name
    assert got.entropy is not None and want.entropy is not None
    assert _worst(got.entropy, want.entropy) <= TOL
    assert got.routes is not None and torch.equal(got.routes, want.routes)
    assert packed.rollout_router_agreement(as_collated, got.routes).agreement == 1.0

    step = dict(loss_fn=_loss, micro_batch_size=MICRO, entropy=True, capture_routes=True)
    step_want, step_got = padded.train_step(batch, **step), packed.train_step(as_collated, **step)
    assert step_got.replayed and step_got.num_microbatches == 3
    assert step_got.routes is not None
    assert packed.rollout_router_agreement(as_collated, step_got.routes).agreement == 1.0
    assert abs(step_got.loss - step_want.loss) <= 1e-6, (step_got.loss, step_want.loss)
    relative = abs(step_got.grad_norm - step_want.grad_norm) / step_want.grad_norm
    assert relative <= TOL, (pair.name, step_got.grad_norm, step_want.grad_norm)
    grads = clipped_grads(padded)
    weights_want, weights_got = dict(padded.export_weights()), dict(packed.export_weights())
    assert max(_worst(weights_want[n], pair.hf[n]) for n in pair.hf) > 1e-3  # it moved
    worst = steady_worst(weights_got, weights_want, grads)
    print(
        f"{pair.name}: logprobs {_worst(got.logprobs, want.logprobs):.2g}, loss "
        f"{abs(step_got.loss - step_want.loss):.2g}, grad norm {relative:.2g} rel, "
        f"weights {worst:.2g}"
    )
    assert worst <= TOL


def test_packed_row_attends_to_no_other_row(builtin: Pair) -> None:
    """Row 1's log-probs packed behind row 0 equal row 1's alone, and stay when row 0's
    tokens change (both within 1e-5; 9.5e-7 measured, the rows' matmuls at other
    lengths). With the document mask one token wider (row 1's first token seeing row
    0's last, tried by hand), row 1's log-probs moved by 3.4 and this test failed."""
    packed, batch = builtin.fresh().packed, slice_batch(builtin.batch, 0, 2)
    alone = packed.forward(batch, micro_batch_size=1, replay_routes=True).logprobs
    together = packed.forward(batch, micro_batch_size=None, replay_routes=True).logprobs
    assert _worst(together[1], alone[1]) <= TOL
    other = batch.sequences.clone()
    other[0] = torch.where(batch.attention_mask[0].bool(), (other[0] + 7) % 256, other[0])
    changed = dataclasses.replace(batch, sequences=other)
    moved = packed.forward(changed, micro_batch_size=None, replay_routes=True).logprobs
    assert _worst(moved[0], together[0]) > 1e-3  # row 0 itself did change
    assert _worst(moved[1], together[1]) <= TOL


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_reordering_plan_returns_rows_in_batch_order(builtin: Pair, layout: str) -> None:
    """A plan whose microbatches take rows out of order (a token budget's bins): the
    log-probs, entropy and captured routes come back row for row in the batch's order,
    the routes the batch's own under replay."""
    builtin.fresh()
    worker, batch = getattr(builtin, layout), builtin.batch
    assert not REORDERED.is_consecutive
    kwargs = dict(replay_routes=True, capture_routes=True, entropy=True)
    want = builtin.padded.forward(batch, micro_batch_size=1, **kwargs)
    got = worker.forward(batch, micro_batch_size=REORDERED, **kwargs)
    assert _worst(got.logprobs, want.logprobs) <= TOL
    assert got.entropy is not None and want.entropy is not None
    assert _worst(got.entropy, want.entropy) <= TOL
    assert got.routes is not None and torch.equal(got.routes, want.routes)
    assert worker.rollout_router_agreement(batch, got.routes).agreement == 1.0
    step = worker.train_step(
        batch, loss_fn=_loss, micro_batch_size=REORDERED, entropy=True, capture_routes=True
    )
    assert step.num_microbatches == REORDERED.count
    assert step.routes is not None and torch.equal(step.routes, want.routes)


def test_r2_replays_the_packed_forwards_own_routes(builtin: Pair) -> None:
    """R2 packed: the old-logprob forward's captured routes (the batch layout, as the
    trainer puts them on the update batch) replay in a packed update step exactly as in
    a padded one, and every update router agrees with them."""
    builtin.fresh()
    batch = dataclasses.replace(builtin.batch, routed_experts=None, router_padding_mask=None)
    own = builtin.packed.forward(batch, micro_batch_size=MICRO, capture_routes=True)
    want_own = builtin.padded.forward(batch, micro_batch_size=MICRO, capture_routes=True)
    real = batch.attention_mask.bool()  # padding columns: routed padded, filler packed
    assert own.routes is not None and torch.equal(own.routes[real], want_own.routes[real])
    r2 = dataclasses.replace(
        batch, routed_experts=own.routes, router_padding_mask=~batch.attention_mask.bool()
    )
    step = dict(loss_fn=_loss, micro_batch_size=MICRO, entropy=True, capture_routes=True)
    got, want = builtin.packed.train_step(r2, **step), builtin.padded.train_step(r2, **step)
    assert got.replayed and got.routes is not None
    assert builtin.packed.rollout_router_agreement(r2, got.routes).agreement == 1.0
    assert abs(got.loss - want.loss) <= 1e-6
    assert abs(got.grad_norm - want.grad_norm) <= TOL * want.grad_norm


def test_sdpa_kernel_per_row_matches_padded(builtin: Pair) -> None:
    packed = _packed_worker(builtin.folder, builtin.arch, attention="sdpa")
    assert packed.model.config._attn_implementation == "skyrl_packed_sdpa"
    want = builtin.fresh().padded.forward(builtin.batch, micro_batch_size=MICRO, replay_routes=True)
    got = packed.forward(builtin.batch, micro_batch_size=MICRO, replay_routes=True)
    assert _worst(got.logprobs, want.logprobs) <= TOL


def test_packed_attention_refuses_what_it_cannot_run() -> None:
    packed_attention.register_attention()
    module = torch.nn.Module()
    q = torch.randn(1, 2, 6, 4)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    eager = packed_attention._eager_documents
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: expected the packed row"):
        eager(module, q, q, q, None)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: expected 0\.\.6 .* got 0\.\.5"):
        eager(module, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match=r"sliding_window: expected .* \(4 tokens\), got 3"):
        eager(module, q, q, q, None, cu_seq_lens_q=cu, sliding_window=3)
    out, _ = eager(module, q, q, q, None, cu_seq_lens_q=cu, sliding_window=4)
    assert out.shape == (1, 6, 2, 4)
    with pytest.raises(ValueError, match=r"attn_implementation: expected one of .* got 'flex'"):
        packed_attention.attention_implementation("flex", device_type="cpu", param_dtype="float32")


def test_flash_attention_only_on_cuda_with_bf16_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' varlen flash kernel where it can run (CUDA, ``flash_attn``, bf16:
    it has no fp32 kernel); the per-row kernels everywhere else."""
    monkeypatch.setattr(packed_attention, "flash_attention_installed", lambda: True)
    choose = packed_attention.attention_implementation
    assert choose("eager", device_type="cuda", param_dtype="bfloat16") == "flash_attention_2"
    assert choose("eager", device_type="cuda", param_dtype="float32") == "skyrl_packed_eager"
    assert choose("sdpa", device_type="cpu", param_dtype="bfloat16") == "skyrl_packed_sdpa"
