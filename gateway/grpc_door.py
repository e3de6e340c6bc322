"""The gRPC front door, Conversation.Converse: one Session per call; its events and its reply audio, played out in
real time, go back on the same stream, and a client that stops reading them is cut off."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.downlink import DOWNLINK_STALL_S, DownlinkWatch
from gateway.registry import SessionRegistry
from gateway.session import ReplyFrame, Session
from voicemesh import telemetry
from voicemesh.errors import RequestError, precondition
from voicemesh.frames import FrameChecker
from voicemesh.serving import merge_reader, refuse, stream_handler
from voicemesh.v1 import conversation_pb2, conversation_pb2_grpc

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[conversation_pb2.ConverseRequest, conversation_pb2.ConverseEvent]


class ConversationServicer(conversation_pb2_grpc.ConversationServicer):
    """Converse for servers: a SessionConfig, then frames and client reports in; events out."""

    def __init__(self, registry: SessionRegistry, downlink_stall_s: float = DOWNLINK_STALL_S) -> None:
        self.registry = registry
        self.downlink_stall_s = downlink_stall_s
        self._aborts: set[asyncio.Task[None]] = set()

    @stream_handler
    async def Converse(
        self,
        request_iterator: AsyncIterator[conversation_pb2.ConverseRequest],
        context: Context,
    ) -> AsyncIterator[conversation_pb2.ConverseEvent]:
        principal = self.registry.authenticate(_authorization(context), "grpc")
        self.registry.admit(principal, _address(context.peer()))
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("request") != "config":
            raise precondition("the first message must be a SessionConfig; got an audio frame")
        session = await self.registry.open_session(first.config, door="grpc", principal=principal)
        checker = FrameChecker(session.options.input_rate_hz, self.registry.max_audio_ahead_ms)
        downlink = DownlinkWatch(self.downlink_stall_s)

        async def read() -> None:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind == "report":
                    session.on_client_report(request.report)
                    continue
                if kind != "frame":
                    raise precondition("a second SessionConfig was sent; send it once, as the first message")
                checker.check(request.frame)
                session.push_frame(request.frame)
            await session.finish()

        async def play(frame: ReplyFrame, sent_us: int) -> None:
            # Into the event stream, so a reply's last frame comes before its reply_done.
            session.deliver(frame.event(sent_us))

        player = session.playout.start(play)
        cut_off = asyncio.ensure_future(
            self._cut_off(context, request_iterator, session, downlink, asyncio.current_task())
        )
        try:
            async for event in merge_reader(read(), session.events):
                if isinstance(event, RequestError):
                    raise event
                with downlink.sending():  # gRPC resumes this generator once the event went into the call's window
                    yield event
        finally:
            cut_off.cancel()
            player.cancel()
            await asyncio.gather(cut_off, player, return_exceptions=True)
            await self.registry.end_session(session)
            log.info("session ended", extra={"session_id": session.options.session_id, "frames": checker.frames})

    async def _cut_off(
        self,
        context: Context,
        caller: AsyncIterator[conversation_pb2.ConverseRequest],
        session: Session,
        downlink: DownlinkWatch,
        handler: asyncio.Task[Any] | None,
    ) -> None:
        """A client that stopped reading: the call ends with RESOURCE_EXHAUSTED, and its session with it.

        The handler is stuck in gRPC's send of the event it yielded, which completes only if the client reads, so
        the status is sent from here, in a task of its own, at a pause in the client's writing (`refuse`; the client
        gets it after what it has not read yet, if it ever reads), and the handler is cancelled: gRPC lets go of the generator, whose `finally` runs as it is
        closed. The session is ended here as well, so that its slot and its backend streams are free at once.
        """
        error = await downlink.stalled
        session_id = session.options.session_id
        log.info(
            "request refused",
            extra={"rpc": "Converse", "code": error.code.name, "reason": error.message, "session_id": session_id},
        )
        telemetry.ERRORS.labels("Converse", error.code.name).inc()
        abort = asyncio.ensure_future(refuse(context, error.code, error.message, caller))
        self._aborts.add(abort)
        abort.add_done_callback(self._aborted)
        if handler is not None:
            handler.cancel()
        await self.registry.end_session(session)

    def _aborted(self, abort: asyncio.Task[None]) -> None:
        self._aborts.discard(abort)
        if not abort.cancelled():
            abort.exception()  # AbortError: how a refusal always ends


def _address(peer: str) -> str:
    """The client's address from gRPC's peer string ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"), port dropped."""
    address = peer.partition(":")[2] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return address.rpartition(":")[0] or address


def _authorization(context: Context) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value.decode() if isinstance(value, bytes) else value
    return ""
