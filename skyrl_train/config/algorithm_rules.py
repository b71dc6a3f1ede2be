"""Launch rules for ``trainer.algorithm`` keys that act only beside another key: each is
refused where it would be accepted and do nothing.

``skip_flat_steps`` and ``zero_variance_filter`` act on flat groups, which only a group
baseline with nothing else to fall back on leaves at zero advantage
(``FLAT_GROUP_ZERO_ESTIMATORS``: grpo, rloo); ``turn_grpo`` scores a flat group's turns
against the batch and ``reinforce++`` whitens over the batch, so neither has a step for
them to act on. ``entropy_target`` and ``entropy_ceiling`` scale the entropy bonus's
coefficient, so they need a bonus (``use_entropy_loss`` with ``entropy_loss_coef`` > 0),
and a ceiling at or below the target would switch the raised bonus off;
``entropy_loss_coef_end`` schedules it, so an end above 0 needs ``use_entropy_loss``.
"""

from __future__ import annotations

from skyrl_train.algorithms.advantages import FLAT_GROUP_ZERO_ESTIMATORS
from skyrl_train.config.schema import PPOConfig
from skyrl_train.errors import ConfigValidationError

ALGORITHM = "trainer.algorithm"


def check_algorithm_options(cfg: PPOConfig) -> None:
    """Refuse a flat-group option turned on under an estimator without flat groups,
    ``entropy_target``, ``entropy_ceiling`` or ``entropy_loss_coef_end`` without an
    entropy bonus to act on, and a ceiling at or below the target."""
    alg = cfg.trainer.algorithm
    estimator = alg.advantage_estimator
    if estimator not in FLAT_GROUP_ZERO_ESTIMATORS:
        for name in ("skip_flat_steps", "zero_variance_filter"):
            if getattr(alg, name):
                raise ConfigValidationError(
                    f"{ALGORITHM}.{name}",
                    expected=f"{'null or ' if name == 'skip_flat_steps' else ''}false with "
                    f"{ALGORITHM}.advantage_estimator {estimator!r}, which gives no group "
                    f"zero advantage (it acts only with {' or '.join(FLAT_GROUP_ZERO_ESTIMATORS)})",
                    got="true",
                )
    for name in ("entropy_target", "entropy_ceiling"):
        value = getattr(alg, name)
        if value is None:
            continue
        if not alg.use_entropy_loss:
            missing = f"{ALGORITHM}.use_entropy_loss false"
        elif alg.entropy_loss_coef == 0:
            missing = f"{ALGORITHM}.entropy_loss_coef 0"
        else:
            continue
        raise ConfigValidationError(
            f"{ALGORITHM}.{name}",
            expected=f"null with {missing} (it scales the entropy bonus's "
            "coefficient, and there is no bonus)",
            got=str(value),
        )
    # The default ends its bonus at 0, which agrees with no bonus at all: only an end
    # that would raise a bonus the run does not have is refused.
    if alg.entropy_loss_coef_end and not alg.use_entropy_loss:
        raise ConfigValidationError(
            f"{ALGORITHM}.entropy_loss_coef_end",
            expected=f"null or 0 with {ALGORITHM}.use_entropy_loss false (it schedules the "
            "entropy bonus's coefficient, and there is no bonus)",
            got=str(alg.entropy_loss_coef_end),
        )
    target, ceiling = alg.entropy_target, alg.entropy_ceiling
    if target is not None and ceiling is not None and ceiling <= target:
        raise ConfigValidationError(
            f"{ALGORITHM}.entropy_ceiling",
            expected=f"above {ALGORITHM}.entropy_target ({target} nats): at or below it "
            "the bonus the target raises is switched off",
            got=str(ceiling),
        )
