"""What a session tells its client: the event queue, bounded, and each failure of a stage as an event a person can act
on (a recoverable outage once, a refusal or a crash as the session's end)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from voicemesh import telemetry
from voicemesh.errors import RequestError
from voicemesh.v1 import conversation_pb2

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 2000  # events the client has not read yet (~40 s of reply audio on the gRPC door); more: it is
# not reading, and the session ends instead of holding its events in memory


class Outbox:
    """One session's events for its client (`events`: ConverseEvent; a RequestError for a fatal problem; None at
    the end), and the record of which stages are down."""

    def __init__(self, session_id: str, turn_index: int = 0) -> None:
        self.session_id = session_id
        self.events: asyncio.Queue[conversation_pb2.ConverseEvent | RequestError | None] = asyncio.Queue()
        self.turn_index = turn_index  # the user's turn in progress: events that name no turn of their own are its
        self._overflowed = False
        self._down: set[str] = set()

    def emit(self, turn: int | None = None, **event: Any) -> None:
        self.deliver(conversation_pb2.ConverseEvent(turn_index=self.turn_index if turn is None else turn, **event))

    def deliver(self, event: conversation_pb2.ConverseEvent) -> None:
        """Queue an event for the client. Past MAX_PENDING_EVENTS unread, the client is not reading: its unread
        events are dropped and the session ends with RESOURCE_EXHAUSTED, so memory stays bounded."""
        if self._overflowed:
            return
        if self.events.qsize() >= MAX_PENDING_EVENTS:
            self._overflowed = True
            while not self.events.empty():
                self.events.get_nowait()
            log.warning("client not reading; session ended", extra={"session_id": self.session_id})
            telemetry.ERRORS.labels("gateway", "RESOURCE_EXHAUSTED").inc()
            self.events.put_nowait(
                RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the client read none of the last {MAX_PENDING_EVENTS} events (replies, their audio); a "
                    "client must read the event stream as it comes",
                )
            )
            return
        self.events.put_nowait(event)

    async def supervised(self, stage: str, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run one of the session's tasks. One that fails in a way nobody handled ends the session with an error
        naming its stage (an event, a metric and a log line) instead of leaving it deaf or mute. (`work` is made
        here, so a task cancelled before it ran leaves no coroutine never awaited.)"""
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.exception("session task failed", extra={"session_id": self.session_id, "stage": stage})
            telemetry.ERRORS.labels(stage, "INTERNAL").inc()
            message = f"the gateway's {stage} stage failed ({type(error).__name__}); start the conversation again"
            self.emit(
                error=conversation_pb2.SessionError(stage=stage, code="INTERNAL", message=message, recoverable=False)
            )
            self.events.put_nowait(RequestError(grpc.StatusCode.INTERNAL, message))

    def report(self, stage: str, error: grpc.aio.AioRpcError) -> None:
        """A backend call failed and will be retried: one error event per outage (every LLM failure, as each
        costs a reply)."""
        if stage in self._down and stage != "llm":
            return  # one error event per outage, not one per reconnect attempt
        self._down.add(stage)
        telemetry.ERRORS.labels(stage, error.code().name).inc()
        log.warning("backend failed", extra={"session_id": self.session_id, "stage": stage, "code": error.code().name})
        self.emit(
            error=conversation_pb2.SessionError(
                stage=stage, code=error.code().name, message=f"{stage} service: {error.details()}", recoverable=True
            )
        )

    def recovered(self, stage: str) -> None:
        if stage in self._down:
            self._down.discard(stage)
            log.info("backend back", extra={"session_id": self.session_id, "stage": stage})

    def fatal_if_bad_request(self, stage: str, error: grpc.aio.AioRpcError) -> bool:
        """The backend refused the session's settings (e.g. an unknown voice): retrying cannot help."""
        if error.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return False
        self.emit(
            error=conversation_pb2.SessionError(
                stage=stage, code=error.code().name, message=error.details(), recoverable=False
            )
        )
        self.events.put_nowait(RequestError(error.code(), f"{stage} service refused the session: {error.details()}"))
        return True
