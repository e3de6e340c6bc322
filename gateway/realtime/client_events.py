"""One Realtime connection: the client's events carried out on its voicemesh session. A bad event gets an `error`
event naming it and the connection goes on; nothing the client sent before it is lost."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from gateway.browser import BrowserSession, Transport
from gateway.protocol import close_code, close_reason
from gateway.realtime.audio import AudioIn
from gateway.realtime.config import RealtimeConfig, RealtimeProblem
from gateway.realtime.events import Item, new_id
from gateway.realtime.transport import RealtimeTransport, check_voice
from gateway.registry import SessionRegistry
from gateway.settings import GatewaySettings
from voicemesh.auth import Principal
from voicemesh.clients import epoch_us
from voicemesh.errors import RequestError
from voicemesh.limits import MAX_TOKENS

log = logging.getLogger(__name__)

# Silence after a client's commit: past the 500 ms a manual session's ASR waits before it closes a turn.
COMMIT_SILENCE_MS = 640
TRANSCRIPT_WAIT_S = 5.0  # how long a commit waits for the transcript of its audio
_FIXED_AFTER_START = (
    ("audio.input.format", "input_format"),
    ("audio.output.format", "output_format"),
    ("audio.output.voice", "voice"),
    ("audio.input.turn_detection", "turn_detection"),
)

Runner = Callable[[BrowserSession, Transport, Awaitable[None]], Awaitable[None]]


class RealtimeConnection:
    """The client's events in, carried out on the session (opened at the first event that needs it)."""

    def __init__(
        self,
        registry: SessionRegistry,
        settings: GatewaySettings,
        principal: Principal,
        transport: RealtimeTransport,
        session_id: str,
        model: str,
        run: Runner,
    ) -> None:
        self.registry = registry
        self.settings = settings
        self.principal = principal
        self.transport = transport
        self.conversation = transport.conversation
        self.session_id = session_id
        self.model = model
        self.run = run
        self.config = RealtimeConfig()
        self.browser: BrowserSession | None = None
        self.audio_in: AudioIn | None = None
        self.uncommitted = False  # audio appended since the last commit (turn detection off)
        self._reading: asyncio.Task[None] | None = None
        self._running: asyncio.Task[None] | None = None
        self._transcribing: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[None]] = set()
        self._handlers: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear_input,
            "conversation.item.create": self._item_create,
            "conversation.item.truncate": self._truncate,
            "conversation.item.delete": self._delete,
            "conversation.item.retrieve": self._retrieve,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
            "output_audio_buffer.clear": self._clear_output,
        }

    def describe(self) -> dict[str, Any]:
        return self.config.describe(self.session_id, self.model)

    async def serve(self, events: AsyncIterator[dict[str, Any]]) -> None:
        """Until the client leaves or its session ends (the session's run closes the socket saying why)."""
        self._reading = asyncio.ensure_future(self._read(events))
        await asyncio.wait({self._reading})
        if self._running is not None:
            await self._running
        if self._transcribing is not None:
            self._transcribing.cancel()
        for task in list(self._sends):
            task.cancel()

    async def _read(self, events: AsyncIterator[dict[str, Any]]) -> None:
        async for event in events:
            if self.browser is not None:
                self.browser.last_audio_s = time.monotonic()  # any event keeps the session from idling out
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            try:
                await self._handle(event)
            except RealtimeProblem as problem:
                await self.transport.send([self.conversation.error(problem, event_id)])
            except RequestError as error:  # the session could not open: the connection ends saying why
                await self.transport.send(
                    [self.conversation.error(RealtimeProblem(error.message, error.code.name.lower()), event_id)]
                )
                await self.transport.ws.close(code=close_code(error), message=close_reason(error.message))
                return

    async def _handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        handler = self._handlers.get(kind) if isinstance(kind, str) else None
        if handler is None:
            known = ", ".join(self._handlers)
            raise RealtimeProblem(f"event type {kind!r} unknown here; send one of: {known}", "unknown_event", "type")
        try:
            await handler(event)
        except (RealtimeProblem, RequestError):
            raise
        except Exception as error:  # a bug in the door: this event fails, the connection goes on
            log.exception("realtime event failed", extra={"session_id": self.session_id, "event": kind})
            raise RealtimeProblem(f"{kind} failed in the server: {error!r}", "server_error") from error

    async def _session(self) -> BrowserSession:
        """The voicemesh session, opened now if need be (RequestError if the gateway refuses it)."""
        if self.browser is not None:
            return self.browser
        config = self.config.session_config(self.session_id)
        session = await self.registry.open_session(config, door="realtime", principal=self.principal)
        if not self.config.turn_detection.replies_on_turns:
            session.reply_on_turns(False)
        session.on_speech = self._on_speech
        browser = BrowserSession(self.registry, session, self.settings.idle_timeout_s, "realtime")
        self.browser, self.audio_in = browser, AudioIn(self.config.input_format)
        self.transport.attach(session.playout, browser.downlink)
        assert self._reading is not None
        self._running = asyncio.ensure_future(self.run(browser, self.transport, self._reading))
        return browser

    def _on_speech(self, started: bool, audio_ms: float) -> None:
        events = self.conversation.speech(started, audio_ms)
        if events:
            task = asyncio.ensure_future(self.transport.send(events))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    # ---- session -------------------------------------------------------------------------------------------
    async def _session_update(self, event: dict[str, Any]) -> None:
        new = self.config.updated(event.get("session"))
        if self.browser is not None:
            for name, attribute in _FIXED_AFTER_START:
                if getattr(new, attribute) != getattr(self.config, attribute):
                    raise RealtimeProblem(
                        f"session.{name} cannot change once the session has started (audio, an item or a response "
                        "came first); send it in the first session.update, or open a new connection",
                        "session_already_started",
                        f"session.{name}",
                    )
            session = self.browser.session
            max_tokens = MAX_TOKENS.resolve(min(new.max_output_tokens or 0, MAX_TOKENS.high), "max_output_tokens")
            pipeline = dataclasses.replace(session.options.pipeline, max_tokens=max_tokens)
            session.options = dataclasses.replace(session.options, system_prompt=new.instructions, pipeline=pipeline)
        elif new.voice and new.voice != self.config.voice:
            assert self.registry.backends is not None
            await check_voice(self.registry.backends, new.voice)
        self.config = self.conversation.config = new
        await self.transport.send([self.conversation.event("session.updated", session=self.describe())])

    # ---- input audio ---------------------------------------------------------------------------------------
    async def _append(self, event: dict[str, Any]) -> None:
        browser = await self._session()
        assert self.audio_in is not None
        for frame in list(self.audio_in.frames(event.get("audio"))):
            self._push(browser, frame)
        self.uncommitted = True

    def _push(self, browser: BrowserSession, frame: bytes) -> None:
        try:
            browser.push_audio(frame, epoch_us())
        except RequestError as error:
            code = "audio_too_fast" if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "invalid_value"
            raise RealtimeProblem(f"{error.message}; the rest of this append was dropped", code, "audio") from error

    async def _commit(self, event: dict[str, Any]) -> None:
        if self.config.turn_detection.type != "none":
            raise RealtimeProblem(
                "with turn detection on, the server commits each turn; set turn_detection to null to commit yourself",
                "not_supported",
                "type",
            )
        if not self.uncommitted:
            raise RealtimeProblem(
                "the input audio buffer is empty; append audio first", "input_audio_buffer_commit_empty"
            )
        browser = await self._session()
        assert self.audio_in is not None
        item = Item(new_id("item"), "user", "input_audio", status="in_progress")
        previous = self.conversation.last_item_id
        committed = self.conversation.event("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id)
        await self.transport.send([committed, *self.conversation.add_item(item)])
        self.uncommitted = False
        try:
            for frame in list(self.audio_in.silence(COMMIT_SILENCE_MS)):
                self._push(browser, frame)
        except RealtimeProblem:
            pass  # a client far ahead of real time: its turn closes on the audio it sends next, or not at all
        previous_commit, self._transcribing = self._transcribing, None
        self._transcribing = asyncio.ensure_future(self._transcribe(item, browser, previous_commit))

    async def _transcribe(self, item: Item, browser: BrowserSession, after: asyncio.Task[None] | None) -> None:
        """Once the ASR has heard the committed audio and its last turn's transcript came, the item's transcript."""
        if after is not None:
            await after
        asr, conversation = browser.session.asr, self.conversation
        heard_seq = asr.seq
        deadline = time.monotonic() + TRANSCRIPT_WAIT_S
        while time.monotonic() < deadline and (asr.acked < heard_seq or conversation.awaiting_final):
            self.transport.final_heard.clear()
            try:
                await asyncio.wait_for(self.transport.final_heard.wait(), 0.05)
            except TimeoutError:
                pass
        text = " ".join(conversation.held)
        conversation.held, conversation.awaiting_final = [], False
        conversation.unanswered.append(item)
        await self.transport.send(conversation.transcribed(item, text))

    async def _clear_input(self, event: dict[str, Any]) -> None:
        self.conversation.held, self.uncommitted = [], False
        await self.transport.send([self.conversation.event("input_audio_buffer.cleared")])

    # ---- conversation items ---------------------------------------------------------------------------------
    async def _item_create(self, event: dict[str, Any]) -> None:
        item = event.get("item")
        if not isinstance(item, dict):
            raise RealtimeProblem("conversation.item.create needs an item", "missing_required_parameter", "item")
        kind, role = item.get("type", "message"), item.get("role")
        if kind != "message":
            raise RealtimeProblem(
                f"item.type={kind!r} is not supported: this server serves no tools; send a user message",
                "not_supported",
                "item.type",
            )
        if role != "user":
            raise RealtimeProblem(
                f"item.role={role!r} is not supported; send user messages (instructions go in session.update)",
                "not_supported",
                "item.role",
            )
        content = item.get("content")
        parts = content if isinstance(content, list) else []
        texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "input_text"]
        if not texts or len(texts) != len(parts) or not all(isinstance(t, str) and t.strip() for t in texts):
            raise RealtimeProblem(
                "item.content must be input_text parts with text (audio goes through input_audio_buffer.append)",
                "invalid_value",
                "item.content",
            )
        await self.transport.send(self.conversation.typed(" ".join(str(t).strip() for t in texts)))

    def _item(self, event: dict[str, Any]) -> Item:
        item_id = event.get("item_id")
        if not isinstance(item_id, str):
            raise RealtimeProblem("item_id is missing", "missing_required_parameter", "item_id")
        item = self.conversation.items.get(item_id)
        if item is None:
            raise RealtimeProblem(f"no item {item_id!r} in this conversation", "item_not_found", "item_id")
        return item

    async def _truncate(self, event: dict[str, Any]) -> None:
        item, heard = self.conversation.truncate(
            event.get("item_id"), event.get("content_index"), event.get("audio_end_ms")
        )
        if self.browser is not None and item.turn_index is not None:
            session = self.browser.session
            response = self.conversation.responses.get(item.turn_index)
            if response is not None and response.status == "in_progress":
                response.cancel_asked = True
                session.cancel_reply()  # as a barge-in: the rest is not spoken
            session.entries.replace(session.history, item.turn_index, "assistant", heard)
        truncated = self.conversation.event(
            "conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=event["audio_end_ms"]
        )
        await self.transport.send([truncated])

    async def _delete(self, event: dict[str, Any]) -> None:
        item = self._item(event)
        conversation = self.conversation
        response = conversation.responses.get(item.turn_index) if item.turn_index is not None else None
        if response is not None and response.status == "in_progress":
            raise RealtimeProblem("the item's response is in progress; cancel it first", "item_in_use", "item_id")
        if self.browser is not None and item.turn_index is not None:
            session = self.browser.session
            session.entries.replace(session.history, item.turn_index, item.role, None)
        conversation.items.pop(item.id, None)
        conversation.unanswered = [kept for kept in conversation.unanswered if kept is not item]
        await self.transport.send([conversation.event("conversation.item.deleted", item_id=item.id)])

    async def _retrieve(self, event: dict[str, Any]) -> None:
        item = self._item(event)
        await self.transport.send([self.conversation.event("conversation.item.retrieved", item=item.describe())])

    # ---- responses ------------------------------------------------------------------------------------------
    async def _response_create(self, event: dict[str, Any]) -> None:
        conversation = self.conversation
        if conversation.active is not None:
            raise RealtimeProblem(
                "a response is in progress; wait for its response.done or send response.cancel",
                "conversation_already_has_active_response",
            )
        params = event.get("response") or {}
        if not isinstance(params, dict) or params.get("conversation", "auto") != "auto":
            raise RealtimeProblem(
                "only responses in the default conversation are supported", "not_supported", "response"
            )
        if self._transcribing is not None:
            await self._transcribing
        text = " ".join(item.text for item in conversation.unanswered if item.text)
        if not text.strip():
            raise RealtimeProblem(
                "nothing to respond to: no user message or committed speech since the last response", "no_input"
            )
        browser = await self._session()
        turn_index = browser.session.respond(text)
        if turn_index is None:
            raise RealtimeProblem("a response is in progress", "conversation_already_has_active_response")
        await self.transport.send(conversation.begin_response(turn_index))

    async def _response_cancel(self, event: dict[str, Any]) -> None:
        response = self.conversation.cancel()
        if response is None:
            raise RealtimeProblem("no response is in progress", "response_cancel_not_active")
        if self.browser is not None:
            self.browser.session.cancel_reply()

    async def _clear_output(self, event: dict[str, Any]) -> None:
        response = self.conversation.cancel()
        if self.browser is not None:
            if response is not None:
                self.browser.session.cancel_reply()
            self.browser.session.playout.flush()
        cleared = self.conversation.event("output_audio_buffer.cleared", response_id=response.id if response else "")
        await self.transport.send([cleared])
