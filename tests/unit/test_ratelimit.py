"""Per-client rate limits: bursts, steady rates, independent clients, bounded memory."""

from __future__ import annotations

import pytest

from voicemesh.ratelimit import RateLimiter


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_passes_then_the_rate_holds_and_other_clients_are_not_affected() -> None:
    clock = FakeClock()
    limiter = RateLimiter(per_minute=60, burst=3, clock=clock)
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    assert limiter.retry_after_s("a") == pytest.approx(1.0)
    assert limiter.allow("b")  # another client has its own bucket
    clock.now = 1.0  # one token back per second at 60/min
    assert limiter.allow("a") and not limiter.allow("a")


def test_a_flood_of_new_keys_keeps_memory_bounded() -> None:
    limiter = RateLimiter(per_minute=10, burst=1, max_keys=100, clock=FakeClock())
    for index in range(10_000):
        limiter.allow(f"client-{index}")
    assert len(limiter._buckets) == 100


def test_nonsense_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        RateLimiter(per_minute=0, burst=1)
