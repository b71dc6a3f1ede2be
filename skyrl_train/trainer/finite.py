"""Stop a run at the first NaN or infinity, before it reaches the inference servers.

The worker skips the optimizer step when the grad norm is not finite, but a finite
norm with a NaN loss, or an update that overflows, still reaches the weights; so the
trainer raises ``NonFiniteError`` on a bad loss or grad norm and checks every parameter
once more at the end of its ``train`` call: the driver never pushes (or checkpoints)
non-finite weights. The launch's teardown then stops every actor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from skyrl_train.errors import NonFiniteError


def require_finite(value: float, *, quantity: str, step: int, where: str) -> None:
    """Raise ``NonFiniteError`` if ``value`` is NaN or infinite; ``where`` says which
    rank and optimizer step, for the message."""
    if not math.isfinite(value):
        raise NonFiniteError(
            quantity,
            step=step,
            reason=f"expected a finite value, got {value} ({where}); the run stops before "
            f"these weights reach the inference servers",
        )


def require_finite_weights(
    named_parameters: Iterable[tuple[str, torch.Tensor]], *, step: int, where: str
) -> None:
    """Raise ``NonFiniteError`` naming the first parameter holding a NaN or infinity.

    One read of every parameter: far cheaper than the export that follows it, which
    converts and copies every tensor.
    """
    with torch.no_grad():
        for name, param in named_parameters:
            if not bool(torch.isfinite(param).all()):
                bad = param[~torch.isfinite(param)].flatten()[0].item()
                raise NonFiniteError(
                    "weights",
                    step=step,
                    parameter=name,
                    reason=f"expected every parameter finite before the push to the "
                    f"inference servers, got {bad} in {name!r} ({where})",
                )
