"""Admission control: refuse at once work that would wait past its budget, instead of dragging p99 for all."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import grpc

from voicemesh.errors import RequestError


class QueueAdmission:
    """Bounds a replica's queue by expected wait, from the service time it measures itself.

    With every one of `slots` busy and `ahead` requests already in line, a newcomer waits about
    (ahead / slots + 1/2) service times (the busy ones are half done on average). Over `budget_ms` it is refused with RESOURCE_EXHAUSTED, so the
    caller can try another replica while this one drains. A budget of 0 turns admission off.
    """

    def __init__(self, slots: int, budget_ms: float, replica: str, smoothing: float = 0.2) -> None:
        self.slots = slots
        self.budget_ms = budget_ms
        self.replica = replica
        self.in_flight = 0
        self.service_ms: float | None = None  # exponential moving average of one request's slot time
        self._smoothing = smoothing

    def expected_wait_ms(self) -> float:
        ahead = self.in_flight - self.slots
        if ahead < 0 or self.service_ms is None:
            return 0.0
        return (ahead / self.slots + 0.5) * self.service_ms

    @contextlib.contextmanager
    def admit(self) -> Iterator[Admitted]:
        """Hold a place for one request, or raise RESOURCE_EXHAUSTED naming the wait and the budget."""
        expected = self.expected_wait_ms()
        if self.budget_ms and expected > self.budget_ms:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"replica {self.replica} is saturated: {self.in_flight} requests in flight for {self.slots} slot(s), "
                f"expected wait ~{expected:.0f} ms > budget {self.budget_ms:.0f} ms; try another replica",
            )
        self.in_flight += 1
        admitted = Admitted(self)
        try:
            yield admitted
        finally:
            admitted.leave()

    def record(self, service_ms: float) -> None:
        """A request held its slot for `service_ms`."""
        if self.service_ms is None:
            self.service_ms = service_ms
        else:
            self.service_ms += self._smoothing * (service_ms - self.service_ms)


class Admitted:
    """One request's place in the queue; `leave` gives it up early (an engine whose replies yield their slot to new
    ones: past its first token a request no longer delays a newcomer)."""

    def __init__(self, admission: QueueAdmission) -> None:
        self._admission = admission
        self._left = False

    def leave(self) -> None:
        if not self._left:
            self._left = True
            self._admission.in_flight -= 1


class StreamLimit:
    """At most `max_streams` concurrent streams on a replica (0 = no limit); more are refused at once."""

    def __init__(self, max_streams: int, replica: str) -> None:
        self.max_streams = max_streams
        self.replica = replica
        self.open = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if self.max_streams and self.open >= self.max_streams:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"replica {self.replica} is at its limit of {self.max_streams} streams; try another replica",
            )
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


def monotonic_ms() -> float:
    return time.monotonic_ns() / 1e6
