"""The inference side's exception tree; callers decide "retry or not" from the class.

    ValueError
      WireError                 a packed envelope or body breaks the wire contract
        GenerateProtocolError   a valid JSON reply whose packed contract is malformed
      RequestValidationError    a generate request field is wrong (the server's 4xx)
      CheckpointFormatError     a model folder cannot be served or trained (names the file
                                and the field)
    GenerateError               anything the client could not turn into a result
      GenerateHTTPError         the server answered with an error status (not retried)
      GenerateTransportError    connection refused/reset, timeout, gateway garbage (retried)
        DeadlineExceeded        the overall deadline ran out while retrying

Protocol and validation errors are deterministic: retrying sends the same bytes and
gets the same failure, so they are ``ValueError`` subclasses and are never retried.
"""

from __future__ import annotations

from typing import Any


def _describe(got: Any) -> str:
    text = repr(got)
    return text if len(text) <= 120 else text[:117] + "..."


class WireError(ValueError):
    """A packed array, envelope or body violates the wire contract.

    ``field`` is a JSON path such as ``$.choices[3].routed_experts.shape``.
    """

    def __init__(self, field: str, expected: str, got: Any) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field}: expected {expected}, got {_describe(got)}")


class GenerateProtocolError(WireError):
    """The server's JSON reply was valid but its packed side channel was not."""


class RequestValidationError(ValueError):
    """A generate request field is invalid; the server answers it with a 4xx."""

    def __init__(self, field: str, expected: str, got: Any, *, status: int = 400) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        self.status = status
        super().__init__(f"{field}: expected {expected}, got {_describe(got)}")


class CheckpointFormatError(ValueError):
    """A checkpoint folder is unusable: a file is missing, or config.json or the
    tokenizer asks for something no family here supports.

    ``field`` names the file and key (``config.json:architectures``).
    """

    def __init__(self, field: str, expected: str, got: Any) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field}: expected {expected}, got {_describe(got)}")


class GenerateError(Exception):
    """Base for failures the client reports after its retry policy ran."""


class GenerateHTTPError(GenerateError):
    """The server answered with an error status; ``message`` is the server's own."""

    def __init__(self, status: int, message: str, *, error_type: str | None = None) -> None:
        self.status = status
        self.message = message
        self.error_type = error_type
        super().__init__(f"HTTP {status}: {message}")


class GenerateTransportError(GenerateError):
    """The request never produced a usable HTTP reply; safe to retry."""


class DeadlineExceeded(GenerateTransportError):
    """The client's overall deadline expired before any attempt succeeded."""
