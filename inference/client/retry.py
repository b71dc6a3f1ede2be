"""Bounded retries for generate calls: exponential backoff, jitter, deadlines.

An earlier client slept a fixed 1 s for 30 attempts with no timeout at all, so a hung
server stalled a rollout forever. Here every attempt has its own timeout, the whole
call has a deadline, and the loop only retries what retrying can fix: the attempt
function signals that by raising ``GenerateTransportError`` (connection refused or
reset, timeout, an undecodable gateway body) or ``RetryLater`` (429/503, which may
carry ``Retry-After``). Everything else propagates on the first attempt.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from inference.errors import DeadlineExceeded, GenerateError, GenerateTransportError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries one call. All times are seconds.

    Backoff before retry n (n = 1, 2, ...) is ``min(max_backoff_s, initial_backoff_s *
    multiplier**(n-1))``, shrunk by a uniform random fraction up to ``jitter`` so that
    many clients failing together do not come back in lockstep. A ``Retry-After`` from
    the server replaces the backoff. Every sleep, ``Retry-After`` ones included, is at
    least ``min_backoff_s`` (even above ``max_backoff_s``); an unparsable ``Retry-After``
    falls back to the backoff. No attempt or sleep runs past ``deadline_s``.
    """

    max_attempts: int = 6
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5
    """Fraction in [0, 1]: each backoff is drawn uniformly from [(1 - jitter)·b, b]."""
    attempt_timeout_s: float = 30.0
    deadline_s: float = 120.0
    min_backoff_s: float = 0.05
    """Floor of every sleep. ``Retry-After: 0``, a negative value or a past HTTP-date
    once made the default policy spend all 6 attempts in about 2 ms on loopback
    (measured), hammering an overloaded server; with this floor they take >= 0.25 s."""

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ValueError(
                f"RetryPolicy.max_attempts: expected an int >= 1, got {self.max_attempts!r}"
            )
        if self.max_attempts < 1:
            raise ValueError(
                f"RetryPolicy.max_attempts: expected an int >= 1, got {self.max_attempts!r}"
            )
        for name in (
            "initial_backoff_s",
            "max_backoff_s",
            "attempt_timeout_s",
            "deadline_s",
            "min_backoff_s",
        ):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RetryPolicy.{name}: expected a finite number > 0, got {value!r}")
        if not _is_real(self.multiplier) or not 1.0 <= self.multiplier < math.inf:
            raise ValueError(
                f"RetryPolicy.multiplier: expected a finite number >= 1, got {self.multiplier!r}"
            )
        if not _is_real(self.jitter) or not 0.0 <= self.jitter <= 1.0:
            raise ValueError(
                f"RetryPolicy.jitter: expected a number in [0, 1], got {self.jitter!r}"
            )
        if self.min_backoff_s >= self.deadline_s:
            raise ValueError(
                f"RetryPolicy.min_backoff_s: expected < deadline_s ({self.deadline_s}), "
                f"got {self.min_backoff_s!r}"
            )
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"RetryPolicy.max_backoff_s: expected >= initial_backoff_s "
                f"({self.initial_backoff_s}), got {self.max_backoff_s!r}"
            )

    def backoff_s(self, retry_number: int, rng: random.Random) -> float:
        """The sleep before retry ``retry_number`` (1-based), jitter applied."""
        base = min(
            self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry_number - 1)
        )
        return base * (1.0 - self.jitter * rng.random())


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RetryLater(GenerateError):
    """An attempt got a retryable status (429/503); ``final`` is raised if retries end.

    ``retry_after_s`` is the server's ``Retry-After`` in seconds, or None.
    """

    def __init__(self, final: GenerateError, retry_after_s: float | None) -> None:
        self.final = final
        self.retry_after_s = retry_after_s
        super().__init__(str(final))


async def call_with_retry(
    attempt: Callable[[float], Awaitable[T]],
    policy: RetryPolicy,
    *,
    what: str,
    rng: random.Random,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """Run ``attempt(timeout_s)`` until it returns, per ``policy``.

    ``timeout_s`` is the time this attempt may take: the per-attempt timeout, cut to
    what is left of the deadline. ``what`` names the call in error messages.
    """
    deadline = clock() + policy.deadline_s
    last: GenerateError | None = None
    for number in range(1, policy.max_attempts + 1):
        remaining = deadline - clock()
        if remaining <= 0:
            raise DeadlineExceeded(
                f"{what}: deadline of {policy.deadline_s} s expired after {number - 1} "
                f"attempt(s); last error: {last}"
            ) from last
        timeout_s = min(policy.attempt_timeout_s, remaining)
        try:
            return await attempt(timeout_s)
        except RetryLater as exc:
            last = exc.final
            delay = exc.retry_after_s
        except GenerateTransportError as exc:
            last = exc
            delay = None
        if number == policy.max_attempts:
            break
        if delay is None:
            delay = policy.backoff_s(number, rng)
        # Retry-After 0, negative or a past date parses to 0.0: floor it like any sleep.
        delay = max(delay, policy.min_backoff_s)
        if clock() + delay >= deadline:
            # Sleeping would leave no time for another attempt: fail now, not later.
            raise DeadlineExceeded(
                f"{what}: deadline of {policy.deadline_s} s leaves no room for a retry "
                f"in {delay:.3g} s after {number} attempt(s); last error: {last}"
            ) from last
        await sleep(delay)
    assert last is not None
    if isinstance(last, GenerateTransportError):
        raise GenerateTransportError(
            f"{what}: gave up after {policy.max_attempts} attempt(s); last error: {last}"
        ) from last
    raise last
