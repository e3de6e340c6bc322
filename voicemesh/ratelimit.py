"""Per-client rate limits: a token bucket per key (a client address or a token's subject), with a bounded
number of keys so that a flood of new keys cannot grow memory."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated_s: float


class RateLimiter:
    """`allow(key)` is True while `key` stays within `per_minute` on average, with bursts of up to `burst`."""

    def __init__(
        self, per_minute: float, burst: int, max_keys: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if per_minute <= 0 or burst < 1:
            raise ValueError("a rate limit needs per_minute > 0 and burst >= 1")
        self.per_minute = per_minute
        self.burst = burst
        self._max_keys = max_keys
        self._clock = clock
        self._buckets: collections.OrderedDict[str, _Bucket] = collections.OrderedDict()

    def allow(self, key: str) -> bool:
        now = self._clock()
        bucket = self._buckets.pop(key, None) or _Bucket(float(self.burst), now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated_s) * self.per_minute / 60)
        bucket.updated_s = now
        self._buckets[key] = bucket  # most recently used last
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)  # an evicted key starts again with a full bucket: fails open, bounded
        if bucket.tokens < 1:
            return False
        bucket.tokens -= 1
        return True

    def retry_after_s(self, key: str) -> float:
        """Seconds until `key` may try again (0 if it may now)."""
        bucket = self._buckets.get(key)
        if bucket is None or bucket.tokens >= 1:
            return 0.0
        return (1 - bucket.tokens) * 60 / self.per_minute
