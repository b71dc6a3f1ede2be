"""Launch rules for scoring tokens under the distribution the rollout sampled from.

The trainer divides its logits by the rollout's temperature and, with a top-k or top-p
cut, scores each token over the kept set the engine sampled it from (sampler replay,
docs/design.md §7). These rules refuse, before anything starts, the sampling settings
that would leave the trainer's log-probabilities different from the sampler's.
"""

from __future__ import annotations

from inference.models.architecture import MoEArchitecture
from skyrl_train.config.off_policy import corrects_off_policy
from skyrl_train.config.schema import PPOConfig, trainer_temperature
from skyrl_train.errors import ConfigValidationError

SAMPLING = "generator.sampling_params"


def check_sampler_replay(cfg: PPOConfig, arch: MoEArchitecture) -> None:
    """Refuse training at temperature 0, a trainer temperature other than the
    rollout's that no off-policy correction weighs, a kept set wider than the side
    channel carries, and a cut the engine backend cannot report."""
    sampling = cfg.generator.sampling_params
    if sampling.temperature == 0.0:
        # The batch-invariant engine gives every sample of a group the same greedy
        # answer: every group is flat and every GRPO advantage is 0.
        raise ConfigValidationError(
            f"{SAMPLING}.temperature",
            expected="> 0 for training (at 0 every sample of a group is the same greedy "
            "answer and every advantage is 0; eval_sampling_params is where greedy "
            "belongs)",
            got="0.0",
        )
    _check_trainer_temperature(cfg)
    cut = sampling.top_k > 0 or sampling.top_p < 1.0
    if not cut:
        return
    backend = cfg.generator.inference_engine.backend
    if backend != "builtin":
        key = f"{SAMPLING}.top_k" if sampling.top_k > 0 else f"{SAMPLING}.top_p"
        value = sampling.top_k if sampling.top_k > 0 else sampling.top_p
        raise ConfigValidationError(
            key,
            expected=f"no top-k/top-p cut with generator.inference_engine.backend={backend} "
            "(sampler replay needs each token's kept set, which only the builtin engine "
            "returns)",
            got=repr(value),
        )
    cap = cfg.generator.max_sample_support_k
    if sampling.top_k > 0:
        if sampling.top_k > cap:
            raise ConfigValidationError(
                "generator.max_sample_support_k",
                expected=f">= {SAMPLING}.top_k ({sampling.top_k}): every token's kept set "
                "travels to the trainer",
                got=str(cap),
            )
        return
    if arch.vocab_size > cap:
        raise ConfigValidationError(
            f"{SAMPLING}.top_k",
            expected=f"a top_k <= generator.max_sample_support_k ({cap}) with top_p < 1: "
            f"top-p alone can keep any of the model's {arch.vocab_size} tokens, more "
            "than a kept set may carry",
            got="-1",
        )


def _check_trainer_temperature(cfg: PPOConfig) -> None:
    explicit = cfg.trainer.algorithm.temperature
    rollout = cfg.generator.sampling_params.temperature
    if explicit is None or explicit == rollout:
        return
    if corrects_off_policy(cfg):
        return
    raise ConfigValidationError(
        "trainer.algorithm.temperature",
        expected=f"null or {rollout} (generator.sampling_params.temperature: tokens are "
        "scored under the distribution they were sampled from)",
        got=f"{explicit}; to "
        f"train at {trainer_temperature(cfg)} on purpose, weigh the difference with an "
        "off-policy correction (trainer.algorithm.off_policy_correction.tis_ratio_type)",
    )
