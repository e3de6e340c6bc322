"""The Realtime WebSocket as a browser-door Transport: the session's events (gateway/protocol.py's JSON) and its
reply frames, played out at real time, leave as GA server events through the connection's RealtimeConversation."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable
from typing import Any

import grpc
from aiohttp import web

from gateway.backends import Backends
from gateway.downlink import DownlinkWatch
from gateway.playout import Playout
from gateway.protocol import close_reason
from gateway.realtime.config import RealtimeProblem
from gateway.realtime.events import Event, RealtimeConversation
from gateway.session import ReplyFrame
from gateway.websocket import CLOSE_TIMEOUT_S
from voicemesh.v1 import audio_pb2, tts_pb2

VOICE_CHECK_TIMEOUT_S = 5.0
RESPONSE_WAIT_S = 1.0  # how long a reply frame waits for the event that begins its response


class RealtimeTransport:
    """Sends server events in order (one lock for the reader's replies, the session's events and the audio)."""

    def __init__(self, ws: web.WebSocketResponse, conversation: RealtimeConversation) -> None:
        self.ws = ws
        self.conversation = conversation
        self.downlink: DownlinkWatch | None = None
        self.final_heard = asyncio.Event()  # a held turn's transcript came (a commit waits for it)
        self.response_begun = asyncio.Event()  # a session event was translated (a response may have begun)
        self._player: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def attach(self, playout: Playout[ReplyFrame], downlink: DownlinkWatch) -> None:
        """The session is open: its reply audio plays out through here."""
        self.downlink = downlink
        self._player = playout.start(self._send_audio)

    async def _send_audio(self, frame: ReplyFrame, sent_us: int) -> None:
        # The playout does not wait for the event stream: a turn's first frame can come before its user_final is
        # sent, which announces the turn's response. The frame waits for it (it is queued already).
        deadline = asyncio.get_running_loop().time() + RESPONSE_WAIT_S
        while frame.turn_index not in self.conversation.responses and asyncio.get_running_loop().time() < deadline:
            self.response_begun.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.response_begun.wait(), 0.05)
        await self.send(self.conversation.audio(frame))

    async def send_json(self, message: dict[str, Any]) -> None:
        """One session event, or a refusal, in the page's JSON (gateway/protocol.py)."""
        events = self._translate(message)
        self.response_begun.set()
        await self.send(events)

    def _translate(self, message: dict[str, Any]) -> list[Event]:
        conversation = self.conversation
        kind, turn = message.get("type"), int(message.get("turn_index", 0))
        if kind == "user_partial":
            return conversation.partial(message["text"])
        if kind == "user_final":
            if conversation.config.turn_detection.type == "none":
                self.final_heard.set()
            return conversation.user_turn(turn, message["text"])
        if kind == "reply_text":
            return conversation.reply_text(turn, message["text_delta"])
        if kind == "reply_done":
            return conversation.finish(turn, "completed")
        if kind == "interrupted":
            response = conversation.responses.get(turn)
            reason = "client_cancelled" if response is not None and response.cancel_asked else "turn_detected"
            return conversation.finish(turn, "cancelled", message["spoken_text"], reason)
        if kind == "metrics":
            return conversation.done(turn, message)
        if kind == "error":
            stage = message.get("stage", "gateway")
            problem = RealtimeProblem(f"{stage}: {message['message']}", str(message["code"]).lower())
            return [conversation.error(problem, kind="server_error")]
        return []  # started (session.created went out at connect), reply_audio (never on this path)

    async def send(self, events: Iterable[Event]) -> None:
        async with self._lock:
            for event in events:
                await self._send_text(json.dumps(event))

    async def _send_text(self, data: str) -> None:
        if self.ws.closed:
            return
        # ConnectionError: the client went away; the reader sees it and ends the session.
        with contextlib.suppress(ConnectionError):
            if self.downlink is None:
                await self.ws.send_str(data)
                return
            with self.downlink.sending():
                await self.ws.send_str(data)

    async def close(self, code: int, reason: str) -> None:
        if self._player is not None:
            self._player.cancel()
            await asyncio.gather(self._player, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ws.close(code=code, message=close_reason(reason)), CLOSE_TIMEOUT_S)


async def check_voice(backends: Backends, voice: str) -> None:
    """Ask a TTS replica whether it serves `voice` (a stream with only its config); RealtimeProblem listing the
    voices it serves if not."""

    async def config_only() -> Any:
        config = tts_pb2.SynthesisConfig(
            session_id="voice-check", voice=voice, encoding=audio_pb2.AUDIO_ENCODING_PCM16LE
        )
        yield tts_pb2.SynthesizeRequest(config=config)

    try:
        target = backends.pick("tts")
        call = backends.synthesizer(target).StreamingSynthesize(config_only(), metadata=backends.metadata())
        async with asyncio.timeout(VOICE_CHECK_TIMEOUT_S):
            async for _ in call:
                pass
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise RealtimeProblem(error.details() or "voice unknown", param="session.audio.output.voice") from error
        raise RealtimeProblem(
            f"the voice cannot be checked now ({error.code().name}); try again", "server_error"
        ) from error
    except TimeoutError as error:
        raise RealtimeProblem(
            "the voice cannot be checked now (the TTS did not answer); try again", "server_error"
        ) from error
