"""Issue 40's differential check on each Hugging Face family: the FSDP worker (transformers'
own model class, routes replayed by gate hooks) against the Megatron worker (converted
weights, megatron-core's routers), same checkpoint, same batch, fp32, R3.

Targets: per-token log-probs within 1e-5, loss within 1e-6, grad norm within 1e-5
relative, weights after one AdamW step within 1e-5 under the HF names. The built-in
model's version, with sampler replay and two ranks, is ``test_fsdp_worker.py``.

``TinySizes()`` checkpoints (dense first layer for the Qwen families, Qwen2-MoE's shared
expert and q/k/v bias, OLMoE's full-width q/k norm without top-k renormalisation,
Mixtral), norms and biases drawn away from 1 and 0 so a misplaced one would show.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fsdp_pairs import build_pair, layout_batch
from _fsdp_pairs import policy_loss as _loss
from _fsdp_pairs import worst as _worst
from _megatron_batches import PAD_ID
from _step_checks import clipped_grads, steady_worst

from inference.models.architecture import TinySizes
from inference.models.families import FAMILIES, describe
from skyrl_train.config.schema import OptimizerConfig
from skyrl_train.trainer.policy import checkpoint_weights

SIZES = TinySizes()
OPT = OptimizerConfig(lr=1e-2, max_grad_norm=1.0)
TOL = 1e-5
MICRO = 2


class Case:
    """One family's checkpoint folder and both backends' workers on its weights."""

    def __init__(self, name: str, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        config = FAMILIES[name].tiny_config(SIZES)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            with torch.no_grad():
                for param in model.parameters():
                    if param.min() == param.max():  # norms at 1, biases at 0
                        param.add_(0.1 * torch.randn_like(param))
        model.save_pretrained(str(folder))
        self.name = name
        self.arch = describe(model.config)
        self.hf = dict(checkpoint_weights(folder))
        self.megatron, self.fsdp = build_pair(folder, self.arch, optimizer=OPT, pad_token_id=PAD_ID)
        self.batch = layout_batch(self.arch, vocab=SIZES.vocab_size, seed=7)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    torch.set_num_threads(1)
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def test_r3_forward_and_one_step_match_megatron(case: Case) -> None:
    megatron, fsdp, batch = case.megatron, case.fsdp, case.batch
    want = megatron.forward(batch, micro_batch_size=MICRO, replay_routes=True, capture_routes=True)
    got = fsdp.forward(batch, micro_batch_size=MICRO, replay_routes=True, capture_routes=True)
    delta = _worst(got.logprobs, want.logprobs)
    assert delta <= TOL, (case.name, delta)
    assert got.routes is not None and torch.equal(got.routes, want.routes)
    assert fsdp.rollout_router_agreement(batch, got.routes).agreement == 1.0

    kwargs = dict(loss_fn=_loss, micro_batch_size=MICRO, entropy=True)
    step_want = megatron.train_step(batch, **kwargs)
    step_got = fsdp.train_step(batch, **kwargs)
    assert step_got.replayed and step_want.replayed
    assert abs(step_got.loss - step_want.loss) <= 1e-6, (step_got.loss, step_want.loss)
    relative = abs(step_got.grad_norm - step_want.grad_norm) / step_want.grad_norm
    assert relative <= TOL, (case.name, step_got.grad_norm, step_want.grad_norm)
    grads = clipped_grads(megatron)
    weights_want, weights_got = dict(megatron.export_weights()), dict(fsdp.export_weights())
    assert sorted(weights_got) == sorted(case.hf)  # compared through the HF names
    assert max(_worst(weights_want[n], case.hf[n]) for n in case.hf) > 1e-3  # it moved
    worst = steady_worst(weights_got, weights_want, grads)
    print(
        f"{case.name}: logprobs {delta:.2g}, loss {abs(step_got.loss - step_want.loss):.2g}, "
        f"grad norm {relative:.2g} rel, weights {worst:.2g}"
    )
    assert worst <= TOL


def test_without_replay_the_random_routes_are_not_what_ran(case: Case) -> None:
    """The check above has teeth: the batch's routes are random, so native routing (no
    gate hook replaying them) disagrees with Megatron's replayed forward far beyond 1e-5."""
    for worker in (case.megatron, case.fsdp):
        worker.load_weights(case.hf.items())
    replayed = case.megatron.forward(case.batch, micro_batch_size=MICRO, replay_routes=True)
    native = case.fsdp.forward(case.batch, micro_batch_size=MICRO, replay_routes=False)
    assert _worst(native.logprobs, replayed.logprobs) > 1e-3
