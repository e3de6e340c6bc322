"""The gateway: the Conversation gRPC front door over the per-session pipeline (browser doors come later)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc

from gateway.backends import Backends
from gateway.options import resolve
from gateway.session import Session
from voicemesh import config, logs
from voicemesh.errors import RequestError, precondition
from voicemesh.frames import FrameChecker
from voicemesh.serving import Server, merge_reader, stream_handler
from voicemesh.v1 import conversation_pb2, conversation_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GatewaySettings(config.ServerSettings):
    """Settings of the gateway (flags or VOICEMESH_GATEWAY_* env)."""

    port: int = config.setting(50051, "gRPC Conversation port")
    asr_target: str = config.setting("127.0.0.1:50061", "ASR service address")
    llm_target: str = config.setting("127.0.0.1:50062", "LLM service address")
    tts_target: str = config.setting("127.0.0.1:50063", "TTS service address")
    max_sessions: int = config.setting(64, "concurrent sessions; more are refused with RESOURCE_EXHAUSTED")
    remembered_sessions: int = config.setting(10_000, "histories kept for reconnects (least recently used go first)")


class HistoryStore:
    """Dialogue histories by session id, so a client that reconnects with its id continues the conversation."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._histories: collections.OrderedDict[str, list[tuple[str, str]]] = collections.OrderedDict()

    def get(self, session_id: str) -> list[tuple[str, str]]:
        history = self._histories.pop(session_id, [])
        self._histories[session_id] = history
        while len(self._histories) > self.capacity:
            self._histories.popitem(last=False)
        return history


class ConversationServicer(conversation_pb2_grpc.ConversationServicer):
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.backends: Backends | None = None
        self.histories = HistoryStore(settings.remembered_sessions)
        self.active: dict[str, Session] = {}

    @stream_handler
    async def Converse(
        self, request_iterator: AsyncIterator[conversation_pb2.ConverseRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[conversation_pb2.ConverseEvent]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("request") != "config":
            raise precondition("the first message must be a SessionConfig; got an audio frame")
        options = resolve(first.config, uuid.uuid4().hex[:16])
        assert self.backends is not None
        if len(self.active) >= self.settings.max_sessions:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this gateway is at its limit of {self.settings.max_sessions} sessions; retry shortly or use another replica",
            )
        previous = self.active.pop(options.session_id, None)
        if previous is not None:  # a reconnect while the old call is still open: the new one takes over
            await previous.close()
        history = self.histories.get(options.session_id)
        session = Session(options, self.backends, history)
        self.active[options.session_id] = session
        checker = FrameChecker(options.input_rate_hz)
        log.info("session started", extra={"session_id": options.session_id, "history_turns": len(history) // 2})
        session.events.put_nowait(
            conversation_pb2.ConverseEvent(
                started=conversation_pb2.SessionStarted(session_id=options.session_id, history_turns=len(history) // 2)
            )
        )

        async def read() -> None:
            async for request in request_iterator:
                if request.WhichOneof("request") != "frame":
                    raise precondition("a second SessionConfig was sent; send it once, as the first message")
                checker.check(request.frame)
                session.push_frame(request.frame)
            await session.finish()

        try:
            async for event in merge_reader(read(), session.events):
                if isinstance(event, RequestError):
                    raise event
                yield event
        finally:
            await session.close()
            if self.active.get(options.session_id) is session:
                del self.active[options.session_id]
            log.info("session ended", extra={"session_id": options.session_id, "frames": checker.frames})


def build_server(settings: GatewaySettings) -> Server:
    servicer = ConversationServicer(settings)

    async def load() -> None:
        # Channels belong to the serving event loop, so they are made here, not before it runs.
        servicer.backends = Backends(settings.asr_target, settings.llm_target, settings.tts_target)

    return Server(
        settings,
        [conversation_pb2.DESCRIPTOR.services_by_name["Conversation"].full_name],
        lambda server: conversation_pb2_grpc.add_ConversationServicer_to_server(servicer, server),
        load,
        servicer,
    )


def main(argv: Sequence[str] | None = None) -> None:
    settings = config.from_argv(GatewaySettings, "gateway", argv, prog="voicemesh serve gateway")
    logs.configure(settings.log_level, "gateway")
    asyncio.run(build_server(settings).run_until_signal())


if __name__ == "__main__":
    main()
