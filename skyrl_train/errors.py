"""The training side's exception tree. All are ``ValueError`` subclasses: each one
reports bad data or bad configuration, which retrying cannot fix.

    ValueError
      ConfigValidationError   a config key is inconsistent or unsupported (names the key)
        DatasetError          a dataset file or row is unusable (names key, file, row, field)
      CheckpointError         a checkpoint file is missing, extra, damaged or unreadable
                              (names the config key and the file)
      NonFiniteError          the loss, grad norm or a weight went NaN/inf (names the
                              quantity, the step and, for weights, the parameter)
      RouteTraceError         a turn's routes do not fit the trajectory (names trajectory, turn)
      CollationError          a sample cannot be collated into the batch (names trajectory)
      RouteReplayError        routes cannot be replayed by the trainer (names trajectory, layer)
"""

from __future__ import annotations

from pathlib import Path


class ConfigValidationError(ValueError):
    """A config key is set to something the pipeline refuses; ``key`` names it."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


class DatasetError(ConfigValidationError):
    """A ``data.train_data``/``data.val_data`` file or one of its rows is unusable.

    ``key`` is the config entry (``data.train_data[0]``), ``path`` the file, ``row``
    the 0-based row (None for the whole file) and ``field`` the row's key (None when
    the row itself is bad); the message reads ``key: path row N: field: reason``.
    """

    def __init__(
        self,
        key: str,
        path: str | Path,
        *,
        row: int | None,
        field: str | None,
        reason: str,
    ) -> None:
        self.path = Path(path)
        self.row = row
        self.field = field
        where = str(path) + (f" row {row}" if row is not None else "")
        super().__init__(key, f"{where}: {field + ': ' if field else ''}{reason}")


class CheckpointError(ValueError):
    """A checkpoint folder does not hold what its manifest says it should.

    ``key`` is the config key that pointed at it (``trainer.resume_from``), ``path``
    the offending file; the message reads ``key: path: expected ..., got ...``.
    """

    def __init__(self, key: str, path: str | Path, *, expected: str, got: str) -> None:
        self.key = key
        self.path = Path(path)
        self.expected = expected
        self.got = got
        super().__init__(f"{key}: {path}: expected {expected}, got {got}")


class NonFiniteError(ValueError):
    """A training quantity went NaN or infinite; the run stops before the weights
    reach the inference servers or a checkpoint.

    ``quantity`` is the metric name (``train/policy_loss``, ``train/grad_norm``) or
    ``weights``; ``parameter`` names the first bad parameter (weights only, else None).
    """

    def __init__(
        self, quantity: str, *, step: int, reason: str, parameter: str | None = None
    ) -> None:
        self.quantity = quantity
        self.step = step
        self.parameter = parameter
        super().__init__(f"{quantity} at step {step}: {reason}")


class RouteTraceError(ValueError):
    """A turn's route rows do not line up with the trajectory's tokens."""


class CollationError(ValueError):
    """A trajectory cannot be collated into the training batch."""


class RouteReplayError(ValueError):
    """Recorded routes cannot be replayed through the trainer's routers."""
