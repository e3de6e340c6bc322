"""A session as a browser door runs it, over WebSocket or WebRTC: checked frames and the page's control messages in,
events out to its transport, an idle timeout, a cut-off for a page that stops reading, and a close that tells the page
why."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, Protocol

import grpc
from google.protobuf import json_format

from gateway.downlink import DOWNLINK_STALL_S, DownlinkWatch
from gateway.protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_OK,
    CLOSE_TAKEN_OVER,
    close_code,
    error_message,
    event_message,
)
from gateway.registry import SessionRegistry
from gateway.session import Session
from voicemesh.errors import RequestError, invalid
from voicemesh.frames import FrameChecker
from voicemesh.v1 import audio_pb2, conversation_pb2

log = logging.getLogger(__name__)


class Transport(Protocol):
    """What a browser door gives its session: events to the page, and a close with a code and a reason.

    Reply audio is not sent through here: each transport plays the session's playout itself, on its own clock. Both
    go through the session's `downlink` watch, which a transport tells when the page is not reading.
    """

    async def send_json(self, message: dict[str, Any]) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


class BrowserSession:
    """One page's session: frames and control in, events out, until it ends, is taken over, idles out or the page
    goes; then its transport closes with the reason and the session ends."""

    def __init__(
        self,
        registry: SessionRegistry,
        session: Session,
        idle_timeout_s: float,
        door: str,
        downlink_stall_s: float = DOWNLINK_STALL_S,
    ) -> None:
        self.registry = registry
        self.session = session
        self.session_id = session.options.session_id
        self.idle_timeout_s = idle_timeout_s
        self.door = door
        self.checker = FrameChecker(session.options.input_rate_hz, registry.max_audio_ahead_ms)
        self.last_audio_s = time.monotonic()
        self.stopping = False
        self.downlink = DownlinkWatch(downlink_stall_s)
        self._transport: Transport | None = None
        self._shutdown = asyncio.Event()
        self._finishing: asyncio.Task[None] | None = None

    def push_audio(self, pcm16: bytes, capture_time_us: int, seq: int | None = None) -> None:
        """One 20 ms frame from the page; raises RequestError for a bad frame. Dropped after a stop."""
        if self.stopping:
            return
        frame = audio_pb2.AudioFrame(
            data=pcm16,
            encoding=audio_pb2.AUDIO_ENCODING_PCM16LE,
            sample_rate_hz=self.session.options.input_rate_hz,
            seq=self.checker.frames if seq is None else seq,
            capture_time_us=capture_time_us,
        )
        self.checker.check(frame)
        self.last_audio_s = time.monotonic()
        self.session.push_frame(frame)

    async def control(self, message: object) -> None:
        """A JSON control message from the page (after the start)."""
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "stop":
            await self.stop()
            return
        if kind == "report" and isinstance(message, dict):
            fields = {k: v for k, v in message.items() if k != "type"}
            try:
                self.session.on_client_report(json_format.ParseDict(fields, conversation_pb2.ClientReport()))
                return
            except json_format.ParseError as error:
                problem = invalid(f"report is not a ClientReport: {error}")
        else:
            problem = invalid(f"control message type {kind!r} unknown; send 'stop' or 'report'")
        if self._transport is not None:
            await self._send(self._transport, error_message(problem, recoverable=True))

    async def stop(self) -> None:
        """The user is done: the last reply plays out, then the event stream ends (and `run` closes the door)."""
        if self.stopping or not self.registry.current(self.session):
            return
        self.stopping = True
        self._finishing = asyncio.ensure_future(self.session.finish())

    def shutdown(self) -> None:
        """The gateway is stopping: close the page's connection (it may reconnect elsewhere with its id)."""
        self._shutdown.set()

    async def run(self, transport: Transport, reader: Awaitable[None]) -> None:
        """Forward events until the session is over, then close the transport with the reason and end the session.

        `reader` consumes the page's side; it returns when the page left (or, after a stop, when the reply played
        out) and raises RequestError for bad input.
        """
        self._transport = transport
        code, reason = CLOSE_GOING_AWAY, "the gateway ended the session"
        try:
            code, reason = await self._pump(transport, reader)
        finally:
            if code != CLOSE_OK:
                self.session.playout.flush()  # the page is told to go: nothing more of the reply
            try:
                await transport.close(code, reason)
            finally:
                await self.registry.end_session(self.session)
                log.info(
                    "browser session ended",
                    extra={"session_id": self.session_id, "door": self.door, "frames": self.checker.frames},
                )

    async def _pump(self, transport: Transport, reader: Awaitable[None]) -> tuple[int, str]:
        """Returns the close code and reason."""
        reading: asyncio.Future[None] = asyncio.ensure_future(reader)
        idle = asyncio.ensure_future(self._idle())
        shutdown = asyncio.ensure_future(self._shutdown.wait())
        stalled = self.downlink.stalled
        getter: asyncio.Future[conversation_pb2.ConverseEvent | RequestError | None] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(self.session.events.get())
                waiting: set[asyncio.Future[Any]] = {getter, reading, idle, shutdown, stalled}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    event = getter.result()
                    if event is None:
                        if self.registry.current(self.session):
                            return CLOSE_OK, "the conversation ended"
                        return CLOSE_TAKEN_OVER, "this conversation continues on a newer connection"
                    if isinstance(event, RequestError):
                        return await self._refuse(transport, event)
                    if await self._send(transport, event_message(event)):
                        continue
                getter.cancel()
                if stalled.done():
                    return await self._refuse(transport, stalled.result())
                if shutdown.done():
                    await self._send_queued(transport)
                    return CLOSE_GOING_AWAY, "the gateway is shutting down; reconnect to continue"
                if idle.done():
                    return await self._refuse(transport, idle.result())
                try:
                    reading.result()
                except RequestError as error:
                    return await self._refuse(transport, error)
                if not self.stopping:
                    return CLOSE_GOING_AWAY, "the page went away"
                reading = asyncio.get_running_loop().create_future()  # stopped: drain the events to their end
        finally:
            if getter is not None:
                getter.cancel()
            others: list[asyncio.Future[Any]] = [reading, idle, shutdown]
            if self._finishing is not None:
                others.append(self._finishing)
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

    async def _send(self, transport: Transport, message: dict[str, Any]) -> bool:
        """Send one message to the page, or give up on it once the downlink stalled (False): a page that is not
        reading would hold the send, and the session with it, for as long as its connection lasts."""
        stalled = self.downlink.stalled
        if stalled.done():
            return False
        sending = asyncio.ensure_future(transport.send_json(message))
        racing: set[asyncio.Future[Any]] = {sending, stalled}
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        if not sending.done():
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
            return False
        sending.result()
        return True

    async def _send_queued(self, transport: Transport) -> None:
        """Send the events already queued: the drain let the reply finish, and its end (reply_done, the turn's
        metrics) may be queued still when the gateway closes the door."""
        while not self.session.events.empty():
            event = self.session.events.get_nowait()
            if not isinstance(event, conversation_pb2.ConverseEvent):
                return
            if not await self._send(transport, event_message(event)):
                return

    async def _refuse(self, transport: Transport, error: RequestError) -> tuple[int, str]:
        log.info(
            "browser session refused",
            extra={"session_id": self.session_id, "door": self.door, "code": error.code.name, "reason": error.message},
        )
        await self._send(transport, error_message(error))  # not to a page that is not reading: only the close says it
        return close_code(error), error.message

    async def _idle(self) -> RequestError:
        while True:
            silent_s = time.monotonic() - self.last_audio_s
            if silent_s >= self.idle_timeout_s and not self.stopping:
                return RequestError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no audio for {self.idle_timeout_s:g} s, so the session was closed; start again to continue "
                    "(the conversation is remembered)",
                )
            await asyncio.sleep(max(0.05, min(1.0, self.idle_timeout_s - silent_s)))
