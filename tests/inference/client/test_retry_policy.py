"""RetryPolicy validation and the retry loop, on a fake clock (no network, no sleeping)."""

from __future__ import annotations

import asyncio
import random

import pytest

from inference.client import ReplyTooLarge
from inference.client.replies import parse_retry_after, status_error
from inference.client.retry import RetryLater, RetryPolicy, call_with_retry
from inference.errors import (
    DeadlineExceeded,
    GenerateError,
    GenerateHTTPError,
    GenerateProtocolError,
    GenerateTransportError,
    RequestValidationError,
    WireError,
)


def test_exception_tree_is_pinned() -> None:
    # Callers decide "retry or not" from the class: protocol/validation errors are
    # deterministic ValueErrors, transport errors are not ValueErrors.
    assert issubclass(WireError, ValueError)
    assert issubclass(GenerateProtocolError, WireError)
    assert issubclass(RequestValidationError, ValueError)
    assert not issubclass(RequestValidationError, WireError)
    assert issubclass(GenerateHTTPError, GenerateError)
    assert issubclass(GenerateTransportError, GenerateError)
    assert issubclass(DeadlineExceeded, GenerateTransportError)
    assert issubclass(RetryLater, GenerateError)
    assert issubclass(ReplyTooLarge, GenerateProtocolError)  # oversize: never retried
    for cls in (GenerateError, GenerateHTTPError, GenerateTransportError, DeadlineExceeded):
        assert not issubclass(cls, ValueError)
    assert not issubclass(GenerateHTTPError, GenerateTransportError)


def test_default_policy_is_bounded() -> None:
    policy = RetryPolicy()
    assert policy.max_attempts == 6
    assert (policy.initial_backoff_s, policy.max_backoff_s) == (0.2, 5.0)
    assert policy.attempt_timeout_s == 30.0 and policy.deadline_s == 120.0
    assert policy.min_backoff_s == 0.05
    with pytest.raises(AttributeError):
        policy.max_attempts = 7  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
        ({"initial_backoff_s": 0}, "initial_backoff_s"),
        ({"deadline_s": float("inf")}, "deadline_s"),
        ({"attempt_timeout_s": -1.0}, "attempt_timeout_s"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"jitter": 1.5}, "jitter"),
        ({"initial_backoff_s": 2.0, "max_backoff_s": 1.0}, "max_backoff_s"),
        ({"min_backoff_s": 0}, "min_backoff_s"),
        ({"min_backoff_s": -0.1}, "min_backoff_s"),
        ({"min_backoff_s": float("nan")}, "min_backoff_s"),
        ({"min_backoff_s": "0.1"}, "min_backoff_s"),
        ({"min_backoff_s": 5.0, "deadline_s": 5.0}, "min_backoff_s"),
    ],
)
def test_bad_policy_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"RetryPolicy.{field}: expected"):
        RetryPolicy(**kwargs)


def test_backoff_grows_exponentially_within_jitter_and_cap() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(0)
    for n, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        draws = [policy.backoff_s(n, rng) for _ in range(200)]
        assert all(base * 0.5 <= d <= base for d in draws), n
        assert max(draws) - min(draws) > base * 0.3  # jitter really spreads them
    exact = RetryPolicy(initial_backoff_s=0.1, jitter=0.0)
    assert exact.backoff_s(3, rng) == pytest.approx(0.4)


class FakeTime:
    """A clock that only moves when the loop sleeps or an attempt 'takes' time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def run_loop(policy: RetryPolicy, outcomes: list, fake: FakeTime, *, cost_s: float = 0.0):
    """Attempt i raises/returns outcomes[i]; returns (result or exception, timeouts seen)."""
    timeouts: list[float] = []

    async def attempt(timeout_s: float):
        timeouts.append(timeout_s)
        fake.now += min(cost_s, timeout_s)
        outcome = outcomes[len(timeouts) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def main():
        return await call_with_retry(
            attempt, policy, what="POST x", rng=random.Random(0), clock=fake.clock, sleep=fake.sleep
        )

    try:
        return asyncio.run(main()), timeouts
    except Exception as exc:
        return exc, timeouts


def test_transport_errors_retry_until_success() -> None:
    fake = FakeTime()
    policy = RetryPolicy(max_attempts=5, initial_backoff_s=0.1, jitter=0.0)
    outcomes = [GenerateTransportError("reset")] * 3 + ["ok"]
    result, timeouts = run_loop(policy, outcomes, fake)
    assert result == "ok" and len(timeouts) == 4
    assert fake.sleeps == pytest.approx([0.1, 0.2, 0.4])


def test_gives_up_after_max_attempts_with_last_error() -> None:
    fake = FakeTime()
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1)
    result, timeouts = run_loop(policy, [GenerateTransportError("refused")] * 3, fake)
    assert type(result) is GenerateTransportError
    assert "gave up after 3 attempt(s)" in str(result) and "refused" in str(result)
    assert len(timeouts) == 3 and len(fake.sleeps) == 2


@pytest.mark.parametrize(
    "error",
    [
        GenerateProtocolError("$.choices[0].routed_experts.dtype", "uint8", "int32"),
        GenerateHTTPError(400, "$.token_ids: expected a list"),
        ReplyTooLarge(1 << 20, 300 << 20, declared=True),
        ValueError("anything else"),
    ],
)
def test_non_retryable_errors_raise_on_the_first_attempt(error: Exception) -> None:
    result, timeouts = run_loop(RetryPolicy(), [error, "never"], FakeTime())
    assert result is error and len(timeouts) == 1


def test_retry_after_replaces_backoff_and_final_error_is_the_status() -> None:
    fake = FakeTime()
    final = GenerateHTTPError(503, "busy")
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, deadline_s=60.0)
    result, timeouts = run_loop(
        policy, [RetryLater(final, 2.5), RetryLater(final, None), final], fake
    )
    assert fake.sleeps[0] == 2.5 and 0.1 <= fake.sleeps[1] <= 0.2
    assert result is final


def test_retry_after_beyond_the_deadline_fails_fast() -> None:
    fake = FakeTime()
    policy = RetryPolicy(max_attempts=10, deadline_s=5.0)
    result, timeouts = run_loop(
        policy, [RetryLater(GenerateHTTPError(429, "slow"), 60.0)] * 10, fake
    )
    assert isinstance(result, DeadlineExceeded)
    assert len(timeouts) == 1 and fake.sleeps == []  # never slept past the deadline
    assert "429" in str(result) and "deadline of 5.0 s" in str(result)


def test_attempt_timeouts_are_cut_to_the_remaining_deadline() -> None:
    fake = FakeTime()
    policy = RetryPolicy(
        max_attempts=100, initial_backoff_s=0.1, jitter=0.0, attempt_timeout_s=2.0, deadline_s=5.0
    )
    result, timeouts = run_loop(
        policy, [GenerateTransportError("timed out")] * 100, fake, cost_s=10.0
    )
    assert isinstance(result, DeadlineExceeded)
    assert timeouts[:2] == [2.0, 2.0] and timeouts[2] == pytest.approx(0.7)
    assert len(timeouts) == 3 and fake.now <= 5.0


def busy_with(retry_after: str) -> RetryLater:
    """What the client's attempt raises for a 503 carrying this ``Retry-After``."""
    error = status_error(503, b'{"error": {"message": "busy"}}', retry_after)
    assert isinstance(error, RetryLater)
    return error


@pytest.mark.parametrize(
    ("header", "first_sleep"),
    [
        ("0", 0.1),
        ("-4", 0.1),
        ("0.01", 0.1),  # positive but below the floor
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.1),  # an HTTP-date in the past
        ("soon", 0.3),  # unparsable: the normal backoff, not the floor
        ("", 0.3),
        ("2.5", 2.5),  # above the floor: honoured as sent
    ],
    ids=["zero", "negative", "below-floor", "past-date", "garbage", "empty", "honoured"],
)
def test_retry_after_sleeps_never_go_below_the_floor(header: str, first_sleep: float) -> None:
    fake = FakeTime()
    policy = RetryPolicy(
        max_attempts=3, initial_backoff_s=0.3, jitter=0.0, min_backoff_s=0.1, deadline_s=60.0
    )
    result, timeouts = run_loop(policy, [busy_with(header), busy_with(header), "ok"], fake)
    assert result == "ok" and len(timeouts) == 3
    assert fake.sleeps[0] == pytest.approx(first_sleep)
    assert min(fake.sleeps) >= policy.min_backoff_s


def test_retry_after_date_beyond_the_deadline_fails_fast() -> None:
    fake = FakeTime()
    policy = RetryPolicy(max_attempts=10, deadline_s=5.0)
    result, timeouts = run_loop(policy, [busy_with("Fri, 01 Jan 2100 00:00:00 GMT")] * 10, fake)
    assert isinstance(result, DeadlineExceeded) and "503" in str(result)
    assert len(timeouts) == 1 and fake.sleeps == []


def test_backoff_below_the_floor_is_raised_to_it() -> None:
    # The floor wins even over max_backoff_s: a policy cannot configure a busy loop.
    fake = FakeTime()
    policy = RetryPolicy(
        max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.002, min_backoff_s=0.05
    )
    result, _ = run_loop(policy, [GenerateTransportError("reset")] * 3 + ["ok"], fake)
    assert result == "ok" and fake.sleeps == [0.05, 0.05, 0.05]


def test_floor_that_would_pass_the_deadline_fails_fast() -> None:
    fake = FakeTime()
    policy = RetryPolicy(max_attempts=5, min_backoff_s=2.0, deadline_s=3.0)
    result, timeouts = run_loop(policy, [busy_with("0"), busy_with("0"), "ok"], fake, cost_s=1.5)
    assert isinstance(result, DeadlineExceeded) and len(timeouts) == 1
    assert "no room for a retry in 2 s" in str(result)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [(None, None), ("3", 3.0), (" 1.5 ", 1.5), ("-4", 0.0), ("soon", None), ("nan", None)],
)
def test_parse_retry_after_seconds(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header) == seconds


def test_parse_retry_after_http_date() -> None:
    # 2015-10-21 07:28:00 GMT, asked 10 s before.
    got = parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0)
    assert got == pytest.approx(10.0)


def test_client_takes_a_retry_mapping_and_refuses_other_types() -> None:
    from inference.client import RemoteGenerateClient

    client = RemoteGenerateClient("http://127.0.0.1:1", retry={"max_attempts": 2})
    assert client.retry == RetryPolicy(max_attempts=2)
    with pytest.raises(ValueError, match="max_attempts"):
        RemoteGenerateClient("http://127.0.0.1:1", retry={"max_attempts": 0})
    with pytest.raises(TypeError, match="retry: expected a RetryPolicy or a mapping, got int"):
        RemoteGenerateClient("http://127.0.0.1:1", retry=3)  # type: ignore[arg-type]
