"""The training side's exception tree. All are ``ValueError`` subclasses: each one
reports bad data or bad configuration, which retrying cannot fix.

    ValueError
      ConfigValidationError   a config key is inconsistent or unsupported (names the key)
      RouteTraceError         a turn's routes do not fit the trajectory (names trajectory, turn)
      CollationError          a sample cannot be collated into the batch (names trajectory)
      RouteReplayError        routes cannot be replayed by the trainer (names trajectory, layer)
"""

from __future__ import annotations


class ConfigValidationError(ValueError):
    """A config key is set to something the pipeline refuses; ``key`` names it."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


class RouteTraceError(ValueError):
    """A turn's route rows do not line up with the trajectory's tokens."""


class CollationError(ValueError):
    """A trajectory cannot be collated into the training batch."""


class RouteReplayError(ValueError):
    """Recorded routes cannot be replayed through the trainer's routers."""
