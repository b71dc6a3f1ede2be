"""Bearer-token checks shared by every HTTP server the project runs: the builtin
inference server (``inference.server.app``) and the trainer's URL bucket sender
(``inference.vllm.senders.URLBucketSender``).

One rule for both: a request is authorised only if its ``Authorization`` header is
exactly ``Bearer <token>``; anything else (missing, another scheme, bytes that are not
UTF-8, control bytes) is a 401, never a 500. A head the HTTP parser refuses never
reaches a handler; both servers listen through ``connections.GuardedTCPSite``, which
answers it with their ``refuse_malformed`` (401 where a token is needed).
"""

from __future__ import annotations

import hashlib
import hmac

from inference.errors import RequestValidationError

__all__ = ["BearerToken", "unauthorized"]


def _digest(header: str) -> bytes:
    # aiohttp decodes header bytes as UTF-8 with surrogateescape, so a value that is not
    # UTF-8 holds lone surrogates, which a plain .encode() refuses: that was a 500 and a
    # logged traceback per request (the builtin server, then the URL sender). surrogatepass
    # encodes every str, one to one; hashing both sides makes the comparison's time
    # independent of the sent value's length too.
    return hashlib.sha256(header.encode("utf-8", "surrogatepass")).digest()


class BearerToken:
    """The expected ``Authorization`` value for one token, kept only as a digest (so the
    token shows in no repr or log)."""

    __slots__ = ("_expected",)

    def __init__(self, token: str) -> None:
        if not isinstance(token, str) or not token:
            raise ValueError("token: expected a non-empty string, got an empty or non-string one")
        self._expected = _digest(f"Bearer {token}")

    def accepts(self, header: str | None) -> bool:
        """Whether ``header`` (the ``Authorization`` value as aiohttp decoded it; None
        when absent) is ``Bearer <token>``, compared in constant time."""
        return hmac.compare_digest(_digest(header or ""), self._expected)

    def __repr__(self) -> str:
        return "BearerToken(<hidden>)"


def unauthorized(got: str) -> RequestValidationError:
    """The 401 for a request without the right token. ``got`` describes what was wrong,
    never the header's value: that may be a near-miss of the key, and error bodies end
    up in client logs."""
    return RequestValidationError("Authorization", "the header 'Bearer <api key>'", got, status=401)
