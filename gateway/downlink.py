"""The doors' bound on a client that stops reading: a send to it that does not go through in time, or a bounded queue
on the way to it that fills, ends its session with RESOURCE_EXHAUSTED instead of holding its events in memory."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import grpc

from voicemesh.errors import RequestError

DOWNLINK_STALL_S = 10.0  # a client that takes nothing for this long is not reading (real time needs 50 frames/s)
NOT_READING = "the client is not reading"


class DownlinkWatch:
    """Watches one session's sends to its client; `stalled` completes with the error that ends the session.

    A door wraps each send in `sending()`. Sends block when the client stops reading (a full TCP window or HTTP/2
    flow-control window), so while any is pending and none has gone through for `stall_s`, the client is taken to
    have stopped. A door whose sends never block (a queue of its transport's own) calls `overflow` at that queue's
    bound instead. One timer per session, moved only when it fires: nothing per send but two counters.
    """

    def __init__(self, stall_s: float = DOWNLINK_STALL_S) -> None:
        self.stall_s = stall_s
        self._loop = asyncio.get_running_loop()
        self.stalled: asyncio.Future[RequestError] = self._loop.create_future()
        """Done once the client stopped reading, with the RESOURCE_EXHAUSTED that ends its session."""
        self._pending = 0
        self._progress_s = 0.0  # on the loop's clock: the last send that went through, or the first one pending
        self._timer: asyncio.TimerHandle | None = None

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Around one send to the client."""
        if not self._pending:
            self._progress_s = self._loop.time()
        self._pending += 1
        if self._timer is None and not self.stalled.done():
            self._timer = self._loop.call_at(self._progress_s + self.stall_s, self._check)
        try:
            yield
        finally:
            self._pending -= 1
        self._progress_s = self._loop.time()

    def overflow(self, what: str) -> None:
        """A bounded queue on the way to the client is full (`what` says which): it is not reading."""
        self._stop(what)

    def _check(self) -> None:
        self._timer = None
        if not self._pending or self.stalled.done():
            return
        due_s = self._progress_s + self.stall_s
        if self._loop.time() < due_s:  # something went through since the timer was set
            self._timer = self._loop.call_at(due_s, self._check)
            return
        self._stop(f"nothing sent to it went through in {self.stall_s:g} s")

    def _stop(self, why: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.stalled.done():
            message = f"{NOT_READING}; {why}, so the session ended"
            self.stalled.set_result(RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message))
