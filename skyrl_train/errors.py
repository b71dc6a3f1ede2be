"""The training side's exception tree. Every class derives from ``SkyRLTrainError``;
all but the root are also ``ValueError`` subclasses: each one reports bad data or bad
configuration, which retrying cannot fix.

    SkyRLTrainError           root: ``except SkyRLTrainError`` catches all of the below
      ConfigValidationError   a config key is inconsistent or unsupported (``path``)
        DatasetError          a dataset file or row is unusable (``path``, ``file``,
                              ``row``, ``field``)
      CheckpointError         a checkpoint file is missing, extra, damaged or unreadable
                              (``path``, ``file``)
      NonFiniteError          the loss, grad norm or a weight went NaN/inf (names the
                              quantity, the step and, for weights, the parameter)
      RouteTraceError         a turn's routes do not fit the trajectory (names trajectory, turn)
      CollationError          a sample cannot be collated into the batch (names trajectory)
      RouteReplayError        routes cannot be replayed by the trainer (names trajectory, layer)
      ServedWeightsError      an engine serves other weights than the trainer pushed
                              (names the engine, the policy version, the worst token)

``path`` is always the dotted config key to change (``trainer.resume_from``) and the
message starts with it: ``path: expected X, got Y``, or, when a file is at fault,
``path: file: expected X, got Y`` (``file`` a filesystem path, never ``path``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class SkyRLTrainError(Exception):
    """Root of every exception the ``skyrl_train`` package defines."""


class ConfigValidationError(SkyRLTrainError, ValueError):
    """A config key is set to something the pipeline refuses; ``path`` is the dotted
    key and ``reason`` reads ``expected X, got Y``."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class DatasetError(ConfigValidationError):
    """A ``data.train_data``/``data.val_data`` file or one of its rows is unusable.

    ``path`` is the config entry (``data.train_data[0]``), ``file`` the file, ``row``
    the 0-based row (None for the whole file) and ``field`` the row's key (None when
    the row itself is bad); the message reads ``path: file row N: field: reason``.
    """

    def __init__(
        self,
        path: str,
        file: str | Path,
        *,
        row: int | None,
        field: str | None,
        reason: str,
    ) -> None:
        self.file = Path(file)
        self.row = row
        self.field = field
        where = str(file) + (f" row {row}" if row is not None else "")
        super().__init__(path, f"{where}: {field + ': ' if field else ''}{reason}")


class CheckpointError(SkyRLTrainError, ValueError):
    """A checkpoint folder does not hold what its manifest says it should.

    ``path`` is the config key that pointed at it (``trainer.resume_from``), ``file``
    the offending file; the message reads ``path: file: expected ..., got ...``.
    """

    def __init__(self, path: str, file: str | Path, *, expected: str, got: str) -> None:
        self.path = path
        self.file = Path(file)
        self.expected = expected
        self.got = got
        super().__init__(f"{path}: {file}: expected {expected}, got {got}")


class NonFiniteError(SkyRLTrainError, ValueError):
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


class RouteTraceError(SkyRLTrainError, ValueError):
    """A turn's route rows do not line up with the trajectory's tokens."""


class CollationError(SkyRLTrainError, ValueError):
    """A trajectory cannot be collated into the training batch."""


class RouteReplayError(SkyRLTrainError, ValueError):
    """Recorded routes cannot be replayed through the trainer's routers."""


class ServedWeightsError(SkyRLTrainError, ValueError):
    """An engine answered the weight push but does not compute with those weights
    (``trainer.served_weights``). Retrying the push will not fix a broken transport
    or engine; the run stops before training on its rollouts.

    ``url`` is the engine, ``policy_version`` the push it was checked after, ``check``
    the scored probe when it got that far (``served_weights.EngineCheck``).
    """

    def __init__(self, url: str, policy_version: int, reason: str, *, check: Any = None) -> None:
        self.url = url
        self.policy_version = policy_version
        self.check = check
        super().__init__(
            f"engine {url} after the push of policy version {policy_version}: {reason}"
        )
