"""Failover, for every call a session makes: how a failed or hung replica is recognised, how long to wait before the
next try, and the session's long-lived ASR and TTS streams, which outlive their replicas."""

from __future__ import annotations

import asyncio
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc

if TYPE_CHECKING:
    from gateway.backends import Backends
    from gateway.outbox import Outbox

EventT = TypeVar("EventT")
RequestT = TypeVar("RequestT")

# A stream that fails with these moves to another replica, and the failed one is suspect until a health check passes.
FAILOVER_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
WATCH_EVERY_S = 0.1  # how often a watched call's liveness is checked while it is quiet
RECONNECT_BACKOFF_S = (0.2, 2.0)  # a session's stream with no replica to go to tries again after this (doubling)


def replica_failed(error: grpc.aio.AioRpcError) -> bool:
    """The replica died, hung, drained or was full (not a refusal of the request): the work goes elsewhere.

    A stream the server ends while the client is still writing can surface as INTERNAL "Internal error from Core"
    instead of its status (grpc/grpc#36066); a draining replica's UNAVAILABLE is seen that way now and then."""
    if error.code() in FAILOVER_CODES:
        return True
    return error.code() == grpc.StatusCode.INTERNAL and "Internal error from Core" in (error.details() or "")


def stalled(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    """An error the gateway raises itself about a call (no replica, a hung one), handled like the replica's own."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


def unavailable(message: str) -> grpc.aio.AioRpcError:
    """The error a session reports when a stage has no replica to call."""
    return stalled(grpc.StatusCode.UNAVAILABLE, message)


class Backoff:
    """The waits between tries when no replica can take the work now: `first_s`, doubling up to `most_s`."""

    def __init__(self, first_s: float, most_s: float) -> None:
        self.first_s, self.most_s = first_s, most_s
        self.delay_s = first_s  # the next wait

    def reset(self) -> None:
        """A try got somewhere: the next failure waits the shortest time again."""
        self.delay_s = self.first_s

    async def wait(self) -> None:
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, self.most_s)


class Silence:
    """Whether a call is hung or slow. A replica sends something at least every 250 ms while it holds a call (an
    empty keepalive while it waits for a slot or prefills), so one quiet for `quiet_s` is hung (SIGSTOP, a wedged
    event loop); apart from that, its first content (text, or the end) must come within `first_s`."""

    def __init__(self, stage: str, first_s: float, quiet_s: float) -> None:
        self.stage = stage
        self.first_s, self.quiet_s = first_s, quiet_s
        self.started = self.since = time.monotonic()
        self.content = False

    def heard(self, content: bool = True) -> None:
        """A message came; `content`: one of substance (not a keepalive or a score)."""
        self.since = time.monotonic()
        self.content = self.content or content

    def problem(self) -> str | None:
        now = time.monotonic()
        if now - self.since > self.quiet_s:
            return f"the {self.stage} replica sent nothing for {now - self.since:.1f} s"
        if not self.content and now - self.started > self.first_s:
            return f"the {self.stage} replica sent no content in {now - self.started:.1f} s"
        return None


async def watched(
    call: AsyncIterable[EventT], problem: Callable[[], str | None], every_s: float = WATCH_EVERY_S
) -> AsyncIterator[EventT]:
    """The call's messages, checking `problem` while none comes: when it names one (a replica that stopped
    answering), DEADLINE_EXCEEDED with it is raised, and the call is cancelled, for the caller to go elsewhere.

    A gRPC call is read with `read()` (no async generator is left mid-read when the call is given up); other
    iterables (fakes in tests) with `anext`."""
    read: Callable[[], Awaitable[Any]] | None = getattr(call, "read", None)
    if read is None:
        messages = aiter(call)
        read = functools.partial(anext, messages, grpc.aio.EOF)
    pending: asyncio.Future[Any] = asyncio.ensure_future(read())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                if (why := problem()) is not None:
                    raise stalled(grpc.StatusCode.DEADLINE_EXCEEDED, why)
                continue
            message = pending.result()
            if message is grpc.aio.EOF:
                return
            yield message
            pending = asyncio.ensure_future(read())
    finally:
        pending.cancel()
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            cancel()  # a call given up on is ended at the replica too (no-op once it has ended)


class ReconnectingStream(ABC, Generic[RequestT, EventT]):
    """A session's bidi stream to a stage whose replicas are stateless (ASR, TTS), kept up for the whole session.

    A replica that fails, hangs (`_stalled`) or drains is marked suspect and the stream goes to another pick at
    once; with no other replica, the failure is reported and the pick retried after a back-off. Each new stream is
    first given what the session needs it to have (`_connected`: a replay), so no work is lost with a replica."""

    stage: str  # "asr" or "tts"

    def __init__(self, backends: Backends, outbox: Outbox, closing: Callable[[], bool]) -> None:
        self.backends = backends
        self.outbox = outbox  # where the stream's failures are reported
        self._closing = closing  # the session is ending: a stream that ends is not replaced
        self.queue: asyncio.Queue[RequestT | None] | None = None  # the live stream's requests; None while it is down

    def close(self) -> None:
        """No more requests: the stream's request iterator ends (the ASR then flushes the utterance in progress, and
        the replica ends the stream)."""
        if self.queue is not None:
            self.queue.put_nowait(None)

    @abstractmethod
    def _first_request(self) -> RequestT:
        """The stream's configuration, its first message (made again for each new stream)."""

    @abstractmethod
    def _method(self, target: str) -> Callable[..., AsyncIterable[EventT]]:
        """The stub's streaming method on `target`'s channel."""

    @abstractmethod
    def _connected(self) -> None:
        """A new stream is up (`queue` is set): give it what the last one did not finish."""

    @abstractmethod
    def _on_event(self, event: EventT) -> None:
        """Handle one of the stream's events."""

    @abstractmethod
    def _stalled(self) -> str | None:
        """Why the replica is taken for hung, if it is."""

    def _broken(self) -> None:
        """The stream broke off (and will be replaced): take back what it was in the middle of."""

    async def run(self) -> None:
        backoff = Backoff(*RECONNECT_BACKOFF_S)
        stage = self.stage
        while True:
            first = self._first_request()
            queue: asyncio.Queue[RequestT | None] = asyncio.Queue()
            target = ""
            try:
                target = self.backends.pick(stage)
                await self.backends.ready(target)
                call = self._method(target)(_drain(queue, first), metadata=self.backends.metadata())
                self.queue = queue
                self._connected()
                self.outbox.recovered(stage)
                with self.backends.streaming(stage, target):
                    async for event in watched(call, self._stalled):
                        backoff.reset()
                        self._on_event(event)
                if self._closing():
                    return  # the session's side ended and the stage finished its work
                raise stalled(grpc.StatusCode.UNAVAILABLE, f"the {stage.upper()} replica ended the stream")
            except grpc.aio.AioRpcError as error:
                self.queue = None
                queue.put_nowait(None)  # ends the request iterator gRPC's writer task still waits on
                if self.outbox.fatal_if_bad_request(stage, error) or self._closing():
                    return
                self._broken()
                elsewhere = target and len(self.backends.candidates(stage)) > 1
                if elsewhere and replica_failed(error):
                    self.backends.mark_down(stage, target)  # the next pick goes elsewhere
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and elsewhere:
                    continue  # full, not broken: nothing to report
                self.outbox.report(stage, error)
                if elsewhere:
                    continue  # another replica takes over at once
            await backoff.wait()


async def _drain(queue: asyncio.Queue[RequestT | None], first: RequestT) -> AsyncIterator[RequestT]:
    """Request iterator of a long-lived stream: `first`, then the queue until None."""
    yield first
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item
