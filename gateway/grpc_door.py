"""The gRPC front door, Conversation.Converse: one Session per call; its events and its reply audio, played out in
real time, go back on the same stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from gateway.registry import SessionRegistry
from gateway.session import ReplyFrame
from voicemesh.errors import RequestError, precondition
from voicemesh.frames import FrameChecker
from voicemesh.serving import merge_reader, stream_handler
from voicemesh.v1 import conversation_pb2, conversation_pb2_grpc

log = logging.getLogger(__name__)


class ConversationServicer(conversation_pb2_grpc.ConversationServicer):
    """Converse for servers: a SessionConfig, then frames and client reports in; events out."""

    def __init__(self, registry: SessionRegistry) -> None:
        self.registry = registry

    @stream_handler
    async def Converse(
        self,
        request_iterator: AsyncIterator[conversation_pb2.ConverseRequest],
        context: grpc.aio.ServicerContext[conversation_pb2.ConverseRequest, conversation_pb2.ConverseEvent],
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
        try:
            async for event in merge_reader(read(), session.events):
                if isinstance(event, RequestError):
                    raise event
                yield event
        finally:
            player.cancel()
            await asyncio.gather(player, return_exceptions=True)
            await self.registry.end_session(session)
            log.info("session ended", extra={"session_id": session.options.session_id, "frames": checker.frames})


def _address(peer: str) -> str:
    """The client's address from gRPC's peer string ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"), port dropped."""
    address = peer.partition(":")[2] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return address.rpartition(":")[0] or address


def _authorization(
    context: grpc.aio.ServicerContext[conversation_pb2.ConverseRequest, conversation_pb2.ConverseEvent],
) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value.decode() if isinstance(value, bytes) else value
    return ""
