"""Rollout-vs-trainer log-probability mismatch with and without sampler replay.

    OMP_NUM_THREADS=1 python scripts/bench_sampler_replay.py [--prompts 32] [--json]

The builtin engine (bf16, batch invariant, as the default run serves) samples
``--prompts`` seeded byte prompts of the built-in model with R3 routes, at two
settings: temperature 1 without a cut, and temperature 1.5 with top-p 0.9. The trainer
(Megatron-core, fp32, routes replayed) then scores the same tokens two ways:

- before (the trainer until sampler replay): raw logits, compared with the rollout's
  raw logprobs (what the mismatch metrics used to compare) and with the logprobs of
  the distribution the tokens were really drawn from (the behaviour policy, what the
  PPO ratio and TIS assume the rollout logprob is);
- after: logits / T over each token's replayed kept set, against the engine's
  processed logprobs (both the behaviour policy).

Printed per setting: mean and max |dlogp| and the k3 estimate over the generated
tokens (``algorithms.mismatch.logprob_mismatch``, the run's own metric), with the CPU
model. No timing is measured; the figures are deterministic for a seed on a machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.engine.base import (  # noqa: E402
    PROCESSED_LOGPROBS,
    RAW_LOGPROBS,
    EngineRequest,
    SamplingParams,
)
from inference.engine.hf_engine import HFMoEEngine  # noqa: E402
from inference.models.tiny_moe import TinyMoEConfig  # noqa: E402
from skyrl_train.algorithms.mismatch import logprob_mismatch  # noqa: E402
from skyrl_train.config.schema import MegatronConfig  # noqa: E402
from skyrl_train.dataset.batch import TrainingBatch  # noqa: E402
from skyrl_train.dataset.preprocess import convert_to_training_batch  # noqa: E402
from skyrl_train.generators.base import GeneratorOutput  # noqa: E402
from skyrl_train.utils.cpu_topology import cpu_model  # noqa: E402
from skyrl_train.workers.megatron import MegatronPolicyWorker  # noqa: E402

SETTINGS = (("T=1", 1.0, 1.0), ("T=1.5, top-p 0.9", 1.5, 0.9))
PAD = 256


def rollout(
    engine: HFMoEEngine,
    prompts: list[list[int]],
    *,
    temperature: float,
    top_p: float,
    mode: str,
    max_tokens: int,
    vocab: int,
) -> list:
    cut = top_p < 1.0
    requests = [
        EngineRequest(
            p,
            SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=i,
                logprobs_mode=mode,
            ),
            return_routed_experts=True,
            sample_support_k=vocab if cut else 0,
        )
        for i, p in enumerate(prompts)
    ]
    return engine.generate_sync(requests)


def as_batch(prompts: list[list[int]], outputs: list) -> TrainingBatch:
    out = GeneratorOutput(
        prompt_token_ids=prompts,
        response_ids=[o.token_ids for o in outputs],
        loss_masks=[[1] * len(o.token_ids) for o in outputs],
        rewards=[0.0] * len(outputs),
        token_rewards=[[0.0] * len(o.token_ids) for o in outputs],
        stop_reasons=["done"] * len(outputs),
        rollout_metrics={},
        rollout_logprobs=[o.logprobs for o in outputs],
        routed_experts=[np.asarray(o.routed_experts) for o in outputs],
        rollout_sample_support=(
            None
            if outputs[0].sample_support_ids is None
            else [o.sample_support_ids for o in outputs]
        ),
    )
    return convert_to_training_batch(out, pad_token_id=PAD)


def figures(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict:
    m = logprob_mismatch(trainer, rollout, mask)
    return {"mean_abs": m.mean_abs_diff, "max_abs": m.max_abs_diff, "k3": m.k3_kl}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = TinyMoEConfig()
    engine = HFMoEEngine.from_config(config, seed=0)  # bf16, as a run serves
    worker = MegatronPolicyWorker(
        config.architecture(), MegatronConfig(moe_enable_routing_replay=True), pad_token_id=PAD
    ).setup()
    worker.load_weights(engine.state_dict().items())
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(32, 127, size=int(rng.integers(4, 16))).tolist() for _ in range(args.prompts)
    ]
    report: dict = {"cpu": cpu_model(), "prompts": args.prompts, "settings": {}}
    for name, temperature, top_p in SETTINGS:
        kwargs = dict(
            temperature=temperature,
            top_p=top_p,
            max_tokens=args.max_tokens,
            vocab=config.vocab_size,
        )
        processed = rollout(engine, prompts, mode=PROCESSED_LOGPROBS, **kwargs)
        raw = rollout(engine, prompts, mode=RAW_LOGPROBS, **kwargs)
        assert [o.token_ids for o in raw] == [o.token_ids for o in processed]
        batch = as_batch(prompts, processed)
        mask = batch.loss_mask
        raw_rollout = as_batch(prompts, raw).rollout_logprobs
        assert batch.rollout_logprobs is not None and raw_rollout is not None
        bare = TrainingBatch(**{**batch.__dict__, "sample_support": None})
        trainer_raw = worker.forward(bare, replay_routes=True, temperature=1.0).logprobs
        trainer_replayed = worker.forward(
            batch, replay_routes=True, temperature=temperature
        ).logprobs
        report["settings"][name] = {
            "before_vs_raw_rollout": figures(trainer_raw, raw_rollout, mask),
            "before_vs_behaviour": figures(trainer_raw, batch.rollout_logprobs, mask),
            "after": figures(trainer_replayed, batch.rollout_logprobs, mask),
            "tokens": int(mask.sum()),
        }
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"CPU: {report['cpu']}; {args.prompts} prompts x {args.max_tokens} tokens, bf16 engine, "
        f"fp32 trainer, R3 on"
    )
    print(f"{'setting':<18} {'compared':<34} {'mean |dlogp|':>12} {'max |dlogp|':>12} {'k3':>10}")
    rows = (
        ("before_vs_raw_rollout", "before: raw vs raw (old metric)"),
        ("before_vs_behaviour", "before: raw vs behaviour policy"),
        ("after", "after: replayed vs behaviour"),
    )
    for name, per in report["settings"].items():
        for key, label in rows:
            f = per[key]
            print(
                f"{name:<18} {label:<34} {f['mean_abs']:12.4g} {f['max_abs']:12.4g} {f['k3']:10.3g}"
            )
        before, after = per["before_vs_behaviour"]["mean_abs"], per["after"]["mean_abs"]
        print(
            f"{name:<18} {'ratio before/after (vs behaviour)':<34} {before / max(after, 1e-12):12.3g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
