"""The gateway: the Conversation gRPC front door and the browser doors (gateway/web.py) over one session pipeline."""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc

from gateway.backends import Backends
from gateway.options import resolve
from gateway.session import HistoryEntry, Session
from gateway.web import WebDoor
from voicemesh import config, serving, telemetry
from voicemesh.errors import RequestError, precondition
from voicemesh.frames import FrameChecker
from voicemesh.serving import Server, merge_reader, stream_handler
from voicemesh.v1 import conversation_pb2, conversation_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GatewaySettings(config.ServerSettings):
    """Settings of the gateway (flags or VOICEMESH_GATEWAY_* env)."""

    port: int = config.setting(50051, "gRPC Conversation port")
    asr_target: str = config.setting("127.0.0.1:50061", "ASR replicas: host:port[,host:port] or dns:///name:port")
    llm_target: str = config.setting(
        "127.0.0.1:50062", "LLM replicas (sessions stick by rendezvous hash): host:port[,...] or dns:///name:port"
    )
    tts_target: str = config.setting("127.0.0.1:50063", "TTS replicas: host:port[,host:port] or dns:///name:port")
    max_sessions: int = config.setting(64, "concurrent sessions; more are refused with RESOURCE_EXHAUSTED")
    auth_token: str = config.setting(
        "",
        "if set, clients must send `authorization: Bearer <token>` (gRPC metadata or HTTP header; the page "
        "passes it as ?token=); empty = no auth",
    )
    remembered_sessions: int = config.setting(10_000, "histories kept for reconnects (least recently used go first)")
    http_port: int = config.setting(
        8080, "HTTP port of the browser doors (page, /api/offer, /api/ws); -1 = off; with --port 0 it is 0 too"
    )
    ice_servers: str = config.setting(
        "[]", 'STUN/TURN servers for WebRTC as JSON: [{"urls": "turn:host:3478", "username": "u", "credential": "p"}]'
    )
    ice_host_addresses: str = config.setting(
        "", "comma-separated ICE host candidate addresses; empty = 127.0.0.1 when host is loopback, else all interfaces"
    )
    allowed_origins: str = config.setting(
        "", "comma-separated page origins allowed besides the gateway's own (e.g. https://app.example.com; * = any)"
    )
    idle_timeout_s: float = config.setting(60.0, "a browser session that sends no audio this long is closed")
    webrtc_connect_timeout_s: float = config.setting(3.0, "the page moves to WebSocket if WebRTC is not up by then")


class HistoryStore:
    """Dialogue histories by session id, so a client that reconnects with its id continues the conversation."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._histories: collections.OrderedDict[str, list[HistoryEntry]] = collections.OrderedDict()

    def get(self, session_id: str) -> list[HistoryEntry]:
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
        self.check_token(dict(context.invocation_metadata() or ()).get("authorization", ""))
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("request") != "config":
            raise precondition("the first message must be a SessionConfig; got an audio frame")
        session = await self.open_session(first.config, door="grpc")
        checker = FrameChecker(session.options.input_rate_hz)

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

        try:
            async for event in merge_reader(read(), session.events):
                if isinstance(event, RequestError):
                    raise event
                yield event
        finally:
            await self.end_session(session)
            log.info("session ended", extra={"session_id": session.options.session_id, "frames": checker.frames})

    def check_token(self, authorization: str) -> None:
        """With auth_token set, `Bearer <token>` must match (compared in constant time)."""
        expected = self.settings.auth_token
        if expected and not hmac.compare_digest(authorization.encode(), f"Bearer {expected}".encode()):
            raise RequestError(
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token: send metadata authorization: Bearer <token>"
            )

    async def open_session(self, session_config: conversation_pb2.SessionConfig, door: str) -> Session:
        """A new session for any front door: config checked, the session limit applied, history restored.

        A session with the same id that is still open (a reconnect, or the page moving from WebRTC to WebSocket)
        is taken over: it is closed and its event stream ends, and the new one continues its history.
        Raises RequestError for a bad config or a full gateway.
        """
        options = resolve(session_config, uuid.uuid4().hex[:16])
        assert self.backends is not None
        if options.session_id not in self.active and len(self.active) >= self.settings.max_sessions:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this gateway is at its limit of {self.settings.max_sessions} sessions; retry shortly or use another replica",
            )
        previous = self.active.pop(options.session_id, None)
        if previous is not None:
            await previous.close()
            previous.events.put_nowait(None)  # its transport ends; this one takes over
        history = self.histories.get(options.session_id)
        session = Session(options, self.backends, history, transport=door)
        self.active[options.session_id] = session
        telemetry.SESSIONS.labels(door).inc()
        telemetry.ACTIVE_SESSIONS.set(len(self.active))
        log.info(
            "session started",
            extra={"session_id": options.session_id, "door": door, "history_turns": len(history) // 2},
        )
        session.events.put_nowait(
            conversation_pb2.ConverseEvent(
                started=conversation_pb2.SessionStarted(session_id=options.session_id, history_turns=len(history) // 2)
            )
        )
        return session

    async def end_session(self, session: Session) -> None:
        """Stop the session's pipeline and free its slot (unless a newer session with its id took the slot)."""
        await session.close()
        if self.active.get(session.options.session_id) is session:
            del self.active[session.options.session_id]
        telemetry.ACTIVE_SESSIONS.set(len(self.active))


class GatewayServer(Server):
    """The gRPC server plus the browser doors' HTTP server, which starts after the backends and stops first."""

    http: WebDoor | None = None

    @property
    def http_port(self) -> int:
        return self.http.port if self.http is not None else 0

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        await super().stop()


def build_server(settings: GatewaySettings) -> GatewayServer:
    servicer = ConversationServicer(settings)
    server: GatewayServer

    async def load() -> None:
        # Channels belong to the serving event loop, so they are made here, not before it runs.
        servicer.backends = Backends(settings.asr_target, settings.llm_target, settings.tts_target)
        await servicer.backends.start()
        if settings.http_port >= 0:
            server.http = WebDoor(servicer, settings)
            await server.http.start(0 if settings.port == 0 else settings.http_port)

    async def unload() -> None:
        if servicer.backends is not None:
            await servicer.backends.close()

    server = GatewayServer(
        settings,
        [conversation_pb2.DESCRIPTOR.services_by_name["Conversation"].full_name],
        lambda grpc_server: conversation_pb2_grpc.add_ConversationServicer_to_server(servicer, grpc_server),
        load,
        servicer,
        unload,
    )
    return server


def main(argv: Sequence[str] | None = None) -> None:
    settings = config.from_argv(GatewaySettings, "gateway", argv, prog="voicemesh serve gateway")
    serving.run("gateway", settings, build_server)


if __name__ == "__main__":
    main()
