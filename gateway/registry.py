"""The gateway's sessions, whichever door they came in by: one per conversation id, one limit for all doors and one
maximum length, the conversations kept for their owners' reconnects, credentials and the per-client start rate."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import secrets
import uuid
from dataclasses import dataclass

import grpc

from gateway.backends import Backends
from gateway.options import resolve
from gateway.session import HistoryEntry, Session
from gateway.settings import GatewaySettings
from voicemesh import telemetry
from voicemesh.auth import Principal, Unauthenticated
from voicemesh.errors import RequestError
from voicemesh.ratelimit import RateLimiter
from voicemesh.serving import authenticator_for
from voicemesh.v1 import conversation_pb2

log = logging.getLogger(__name__)

ANONYMOUS = Principal("")
RESUME_TOKEN_BYTES = 24


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class RateLimited(RequestError):
    """A client over its session-start rate (RESOURCE_EXHAUSTED; HTTP 429 with Retry-After)."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"too many sessions started from this client; retry in {max(1, round(retry_after_s))} s",
        )


@dataclass
class Conversation:
    """What the gateway keeps of a conversation between connections: its history and who owns it."""

    history: list[HistoryEntry]
    subject: str
    """The JWT subject that started it ("" with the static token or no auth)."""
    resume_digest: bytes
    """SHA-256 of the resume token last issued for it; the token itself is only ever sent to its owner."""

    def owned_by(self, principal: Principal, resume_token: str) -> bool:
        if self.subject and principal.subject == self.subject:
            return True
        return bool(resume_token) and hmac.compare_digest(_digest(resume_token), self.resume_digest)

    def new_resume_token(self) -> str:
        token = secrets.token_urlsafe(RESUME_TOKEN_BYTES)
        self.resume_digest = _digest(token)
        return token


class ConversationStore:
    """Conversations by session id, so that their owner can reconnect and go on; the least recently used go
    first beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._conversations: collections.OrderedDict[str, Conversation] = collections.OrderedDict()

    def find(self, session_id: str) -> Conversation | None:
        conversation = self._conversations.get(session_id)
        if conversation is not None:
            self._conversations.move_to_end(session_id)
        return conversation

    def create(self, session_id: str, subject: str) -> Conversation:
        conversation = Conversation([], subject, b"")
        self._conversations[session_id] = conversation
        while len(self._conversations) > self.capacity:
            self._conversations.popitem(last=False)
        return conversation


class SessionRegistry:
    """The open sessions by id, shared by the gRPC and browser doors; `backends` is set once the channels are up."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.backends: Backends | None = None
        self.conversations = ConversationStore(settings.remembered_sessions)
        self.active: dict[str, Session] = {}
        self._length_limits: dict[Session, asyncio.Task[None]] = {}
        self.authenticator = authenticator_for(settings)
        self.max_audio_ahead_ms = settings.max_audio_ahead_ms or None
        self.draining = False
        rate = settings.session_starts_per_minute
        self._starts = RateLimiter(rate, max(1, round(rate / 6))) if rate > 0 else None

    def authenticate(self, authorization: str, door: str) -> Principal:
        """The caller behind an `authorization` value; a bare UNAUTHENTICATED (counted, reason logged) if none."""
        try:
            return self.authenticator.verify(authorization)
        except Unauthenticated as refused:
            telemetry.UNAUTHENTICATED.labels(door).inc()
            log.info("unauthenticated", extra={"door": door, "reason": str(refused)})
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated") from refused

    def admit(self, principal: Principal, address: str) -> None:
        """A session start (or WebRTC offer) within the per-client rate: by token subject, else by address."""
        client = f"sub:{principal.subject}" if principal.subject else f"ip:{address}"
        if self._starts is not None and not self._starts.allow(client):
            raise RateLimited(self._starts.retry_after_s(client))

    async def open_session(
        self,
        session_config: conversation_pb2.SessionConfig,
        door: str,
        principal: Principal = ANONYMOUS,
    ) -> Session:
        """A new session for any front door: config checked, ownership proven, the session limit applied, history
        restored.

        Resuming an existing id needs its resume token (or the JWT subject that started it); otherwise it is
        PERMISSION_DENIED and the owner's session goes on undisturbed. A session of the owner's that is still
        open (a reconnect, or the page moving from WebRTC to WebSocket) is taken over: it is closed, its event
        stream ends, and the new one continues its history. Raises RequestError for a bad config, a takeover
        attempt or a full gateway.
        """
        if self.draining:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE, "this gateway is shutting down; connect again to reach another replica"
            )
        options = resolve(session_config, uuid.uuid4().hex[:16])
        assert self.backends is not None, "sessions open only after the backends are up"
        conversation = self.conversations.find(options.session_id)
        if conversation is not None and not conversation.owned_by(principal, session_config.resume_token):
            telemetry.TAKEOVERS_REFUSED.labels(door).inc()
            log.warning("session takeover refused", extra={"session_id": options.session_id, "door": door})
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"session_id {options.session_id!r} belongs to another caller: send the resume_token its start "
                "gave you, or leave session_id empty for a new session",
            )
        if options.session_id not in self.active and len(self.active) >= self.settings.max_sessions:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this gateway is at its limit of {self.settings.max_sessions} sessions; retry shortly or use another replica",
            )
        previous = self.active.pop(options.session_id, None)
        if previous is not None:
            await previous.close()
            previous.events.put_nowait(None)  # its transport ends; this one takes over
        if conversation is None:
            conversation = self.conversations.create(options.session_id, principal.subject)
        resume_token = conversation.new_resume_token()
        history = conversation.history
        session = Session(
            options,
            self.backends,
            history,
            transport=door,
            log_transcripts=self.settings.log_transcripts,
            history_max_chars=self.settings.history_max_chars,
            history_max_tokens=self.settings.history_max_tokens,
        )
        session.resume_token = resume_token
        self.active[options.session_id] = session
        if self.settings.max_session_s > 0:
            limit = asyncio.ensure_future(self._end_at_max_length(session, self.settings.max_session_s))
            limit.add_done_callback(_log_failure)
            self._length_limits[session] = limit
        telemetry.SESSIONS.labels(door).inc()
        telemetry.ACTIVE_SESSIONS.set(len(self.active))
        log.info(
            "session started",
            extra={"session_id": options.session_id, "door": door, "history_turns": len(history) // 2},
        )
        started = conversation_pb2.SessionStarted(
            session_id=options.session_id, history_turns=len(history) // 2, resume_token=resume_token
        )
        session.events.put_nowait(conversation_pb2.ConverseEvent(started=started))
        return session

    async def _end_at_max_length(self, session: Session, max_s: float) -> None:
        """After `max_s`, and once the reply being spoken then has played out (at most drain_grace_s more, as in a
        drain), the session's events end with DEADLINE_EXCEEDED: its door closes the call or the socket saying why.

        DEADLINE_EXCEEDED, not RESOURCE_EXHAUSTED: the session ran out of time, and a new one may start at once; here
        RESOURCE_EXHAUSTED means a full gateway or a flood, which clients answer by backing off or going elsewhere."""
        await asyncio.sleep(max_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(session.until_idle(), self.settings.drain_grace_s)
        log.info("session at its maximum length", extra={"session_id": session.options.session_id, "max_s": max_s})
        message = (
            f"the session reached its maximum length of {max_s:g} s; start a new one (the conversation is remembered)"
        )
        session.events.put_nowait(RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, message))  # after what is queued

    async def drain(self, grace_s: float) -> None:
        """Refuse new sessions, and wait (at most `grace_s`) until no open session is speaking a reply."""
        self.draining = True
        speaking = [session.until_idle() for session in self.active.values()]
        if not speaking:
            return
        log.info("draining", extra={"sessions": len(speaking), "grace_s": grace_s})
        try:
            await asyncio.wait_for(asyncio.gather(*speaking), grace_s)
        except TimeoutError:
            log.warning("replies still playing at the end of the drain", extra={"grace_s": grace_s})

    def history(self, session_id: str) -> list[HistoryEntry]:
        """The history kept for `session_id` (empty if none)."""
        conversation = self.conversations.find(session_id)
        return [] if conversation is None else conversation.history

    def current(self, session: Session) -> bool:
        """Still the gateway's session for its id (not ended, not taken over by a newer connection)."""
        return self.active.get(session.options.session_id) is session

    async def end_session(self, session: Session) -> None:
        """Stop the session's pipeline and free its slot (unless a newer session with its id took the slot)."""
        limit = self._length_limits.pop(session, None)
        if limit is not None:
            limit.cancel()
        await session.close()
        if self.current(session):
            del self.active[session.options.session_id]
        telemetry.ACTIVE_SESSIONS.set(len(self.active))


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("session length limit failed", exc_info=task.exception())
