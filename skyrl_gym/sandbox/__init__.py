"""A sandbox for model-written code: ``run_python(code, stdin=..., limits=...)``.

``limits`` (``SandboxLimits``) bounds the run; ``isolation()`` says which kernel
layers this host provides. Design and guarantees: ``runner`` and ``isolation``.
"""

from skyrl_gym.sandbox.isolation import Isolation, isolation
from skyrl_gym.sandbox.limits import DEFAULT_LIMITS, SandboxLimits
from skyrl_gym.sandbox.runner import STATUSES, SandboxResult, run_python

__all__ = [
    "DEFAULT_LIMITS",
    "STATUSES",
    "Isolation",
    "SandboxLimits",
    "SandboxResult",
    "isolation",
    "run_python",
]
