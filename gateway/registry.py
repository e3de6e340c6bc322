"""The gateway's sessions, whichever door they came in by: one per conversation id, one limit for all doors, the
histories kept for reconnects, and the token check."""

from __future__ import annotations

import collections
import hmac
import logging
import uuid

import grpc

from gateway.backends import Backends
from gateway.options import resolve
from gateway.session import HistoryEntry, Session
from gateway.settings import GatewaySettings
from voicemesh import telemetry
from voicemesh.errors import RequestError
from voicemesh.v1 import conversation_pb2

log = logging.getLogger(__name__)


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


class SessionRegistry:
    """The open sessions by id, shared by the gRPC and browser doors; `backends` is set once the channels are up."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.backends: Backends | None = None
        self.histories = HistoryStore(settings.remembered_sessions)
        self.active: dict[str, Session] = {}

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
        assert self.backends is not None, "sessions open only after the backends are up"
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

    def current(self, session: Session) -> bool:
        """Still the gateway's session for its id (not ended, not taken over by a newer connection)."""
        return self.active.get(session.options.session_id) is session

    async def end_session(self, session: Session) -> None:
        """Stop the session's pipeline and free its slot (unless a newer session with its id took the slot)."""
        await session.close()
        if self.current(session):
            del self.active[session.options.session_id]
        telemetry.ACTIVE_SESSIONS.set(len(self.active))
