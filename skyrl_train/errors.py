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
      RolloutDumpError        a rollout dump cannot be read (``file``: names the file)

``path`` is always the dotted config key to change (``trainer.resume_from``) and the
message starts with it: ``path: expected X, got Y``, or, when a file is at fault,
``path: file: expected X, got Y`` (``file`` a filesystem path, never ``path``). The
constructors build that shape: pass ``expected=`` and ``got=`` (already formatted
text; ``got`` is what was found, e.g. ``repr(value)``), never a hand-written
``"expected ..., got ..."``. A positional ``reason`` is for a message that is not an
expected/got fact (another library's message, a rule between keys). ``RouteTraceError``,
``CollationError`` and ``RouteReplayError`` name no config key: their first argument is
the place (``rewards[3]``), or alone the whole message.

A package error is for bad data or configuration that a user can fix: it names the key
or field to change. A bare ``ValueError``/``TypeError`` is for API misuse, a programmer
calling a function wrongly (an empty clients list passed to a constructor, both or
neither of ``reason`` and ``expected``/``got``): no config edit fixes that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference.errors import reduce_by_attributes


class SkyRLTrainError(Exception):
    """Root of every exception the ``skyrl_train`` package defines."""

    def __reduce__(self) -> tuple[Any, ...]:
        # A trainer rank's error reached the driver as Ray's UnserializableException,
        # and ``except SkyRLTrainError`` missed it (``reduce_by_attributes``).
        return reduce_by_attributes(self)


def _reason(reason: str | None, expected: str | None, got: str | None) -> str:
    """``reason``, or ``expected X, got Y``; exactly one of the two forms."""
    if reason is None and expected is not None and got is not None:
        return f"expected {expected}, got {got}"
    if reason is not None and expected is None and got is None:
        return reason
    raise TypeError("pass either reason, or both expected= and got=")


class ConfigValidationError(SkyRLTrainError, ValueError):
    """A config key is set to something the pipeline refuses; ``path`` is the dotted
    key. With ``expected=`` and ``got=`` the message reads ``path: expected X, got Y``
    (``.expected``/``.got`` keep them); a free-form ``reason`` gives ``path: reason``
    (``.expected``/``.got`` None)."""

    def __init__(
        self,
        path: str,
        reason: str | None = None,
        *,
        expected: str | None = None,
        got: str | None = None,
    ) -> None:
        self.path = path
        self.reason = _reason(reason, expected, got)
        self.expected = expected
        self.got = got
        super().__init__(f"{path}: {self.reason}")


class DatasetError(ConfigValidationError):
    """A ``data.train_data``/``data.val_data`` file or one of its rows is unusable.

    ``path`` is the config entry (``data.train_data[0]``), ``file`` the file, ``row``
    the 0-based row (None for the whole file) and ``field`` the row's key (None when
    the row itself is bad); the message reads ``path: file row N: field: expected X,
    got Y`` (or ``...: field: reason`` for a free-form ``reason``).
    """

    def __init__(
        self,
        path: str,
        file: str | Path,
        *,
        row: int | None,
        field: str | None,
        reason: str | None = None,
        expected: str | None = None,
        got: str | None = None,
    ) -> None:
        self.file = Path(file)
        self.row = row
        self.field = field
        where = str(file) + (f" row {row}" if row is not None else "")
        detail = _reason(reason, expected, got)
        super().__init__(path, f"{where}: {field + ': ' if field else ''}{detail}")
        self.expected = expected
        self.got = got


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


class _PlacedError(SkyRLTrainError, ValueError):
    """An error whose message names its own place (no config key): ``where`` alone is
    the whole message; with ``expected=`` and ``got=`` it is the place they describe
    (``rewards[3]``) and the message reads ``where: expected X, got Y``."""

    def __init__(self, where: str, *, expected: str | None = None, got: str | None = None) -> None:
        if (expected is None) != (got is None):
            raise TypeError("pass both expected= and got=, or neither")
        self.expected = expected
        self.got = got
        super().__init__(where if expected is None else f"{where}: expected {expected}, got {got}")


class RouteTraceError(_PlacedError):
    """A turn's route rows do not line up with the trajectory's tokens."""


class CollationError(_PlacedError):
    """A trajectory cannot be collated into the training batch."""


class RouteReplayError(_PlacedError):
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


class RolloutDumpError(SkyRLTrainError, ValueError):
    """A rollout dump (``runs/rollouts.py``) that cannot be read: torn, missing, or of
    another format or version; the message reads ``file: problem``."""

    def __init__(self, file: str | Path, problem: str) -> None:
        self.file = Path(file)
        self.problem = problem
        super().__init__(f"{file}: {problem}")
