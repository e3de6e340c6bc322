"""A conversation over the gateway's OpenAI Realtime door (/v1/realtime) with the interface of `ConversationClient`,
so a load test can drive it: 16 kHz frames in (appended as 24 kHz audio/pcm), GA server events out as the typed
events of voicemesh.conversation.

The Realtime API carries no gateway metrics: the TurnMetrics this client yields holds, as speech_end_capture_us, when
it sent the audio where the server's VAD put the end of speech (input_audio_buffer.speech_stopped), the response's
token usage, the arrival of its first audio, and as reply_gap_ms the silence a listener playing the reply from its
first audio would have heard inside it."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from voicemesh.audio import FRAME_MS, StreamResampler, float_to_pcm16, pcm16_to_float
from voicemesh.clients import PLAINTEXT, Credentials, epoch_us
from voicemesh.conversation import (
    ConversationFailed,
    Event,
    Interrupted,
    ReplyAudio,
    ReplyDone,
    ReplyText,
    SessionError,
    Started,
    TurnMetrics,
    UserTranscript,
)
from voicemesh.v1 import conversation_pb2

RATE_HZ = 24000  # audio/pcm
CLOSE_OK = 1000


@dataclass
class RealtimeConversationClient:
    """One conversation over /v1/realtime. `send` 20 ms of PCM16 at the config's input rate, iterate `events()`,
    `close` ends it once the reply in progress is done. A refusal raises ConversationFailed."""

    target: str
    """The gateway's HTTP door, HOST:PORT (wss:// when `credentials.tls` is set)."""
    config: conversation_pb2.SessionConfig
    credentials: Credentials = PLAINTEXT
    _outbox: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    _http: aiohttp.ClientSession | None = None
    _resampler: StreamResampler | None = None
    _sent_us: list[int] = field(default_factory=list)  # send time of each 20 ms of audio
    _turn: int = 0
    _speech_end_us: int = 0
    _first_audio_us: int = 0
    _responding: bool = False
    _played_until_us: int = 0  # where a listener playing the reply from its first audio would be done
    _gap_ms: float = 0.0  # silence such a listener heard inside the reply (its audio came too late)
    _seq: int = 0

    async def __aenter__(self) -> RealtimeConversationClient:
        self._http = aiohttp.ClientSession()
        self._resampler = StreamResampler(self.config.input_sample_rate_hz or 16000, RATE_HZ)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()

    @property
    def url(self) -> str:
        return f"{'wss' if self.credentials.tls else 'ws'}://{self.target}/v1/realtime?model=voicemesh"

    def send(self, pcm16: bytes) -> None:
        """Queue one frame of the user's audio."""
        assert self._resampler is not None, "use `async with RealtimeConversationClient(...)`"
        self._outbox.put_nowait(float_to_pcm16(self._resampler.process(pcm16_to_float(pcm16))))

    def close(self) -> None:
        self._outbox.put_nowait(None)

    async def events(self) -> AsyncIterator[Event]:
        assert self._http is not None, "use `async with RealtimeConversationClient(...)`"
        ssl = self.credentials.tls.ssl_context() if self.credentials.tls else None
        headers = {"Authorization": f"Bearer {self.credentials.token}"} if self.credentials.token else {}
        try:
            ws = await self._http.ws_connect(
                self.url,
                headers=headers,
                ssl=ssl if ssl is not None else True,
                max_msg_size=0,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None),
            )
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ConversationFailed("UNAVAILABLE", f"cannot open {self.url}: {error}") from error
        writer: asyncio.Future[None] | None = None
        refusal: tuple[str, str] | None = None
        try:
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                event = json.loads(message.data)
                if event["type"] == "error" and writer is None:  # before session.created: the door refused
                    code = str(event["error"].get("code"))
                    refusal = (
                        "UNAUTHENTICATED" if code == "invalid_api_key" else code.upper(),
                        event["error"]["message"],
                    )
                if event["type"] == "session.created":
                    if self.config.system_prompt:
                        update = {"type": "realtime", "instructions": self.config.system_prompt}
                        await ws.send_str(json.dumps({"type": "session.update", "session": update}))
                    writer = asyncio.ensure_future(self._write(ws))
                for converted in self._convert(event):
                    yield converted
            if ws.close_code not in (None, CLOSE_OK) or refusal is not None:
                status, details = refusal or (f"CLOSE_{ws.close_code}", "the gateway closed the connection")
                raise ConversationFailed(status, details)
        finally:
            if writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            await ws.close()

    def _convert(self, event: dict[str, Any]) -> list[Event]:
        kind = event["type"]
        if kind == "session.created":
            return [Started(event["session"]["id"], 0)]
        if kind == "input_audio_buffer.speech_stopped":
            frame = min(len(self._sent_us) - 1, int(event["audio_end_ms"]) // FRAME_MS)
            self._speech_end_us = self._sent_us[frame] if frame >= 0 else epoch_us()
        elif kind == "conversation.item.input_audio_transcription.completed":
            return [UserTranscript(self._turn, event["transcript"], final=True)]
        elif kind == "response.created":
            self._responding, self._first_audio_us, self._seq = True, 0, 0
        elif kind == "response.output_audio_transcript.delta":
            return [ReplyText(self._turn, event["delta"])]
        elif kind == "response.output_audio.delta":
            now, pcm16 = epoch_us(), base64.b64decode(event["delta"])
            if not self._first_audio_us:
                self._first_audio_us, self._played_until_us, self._gap_ms = now, now, 0.0
            elif now > self._played_until_us:
                self._gap_ms += (now - self._played_until_us) / 1000
                self._played_until_us = now
            self._played_until_us += len(pcm16) // 2 * 1_000_000 // RATE_HZ
            self._seq += 1
            return [ReplyAudio(self._turn, pcm16, RATE_HZ, "", 0, now, self._seq - 1)]
        elif kind == "response.done":
            return self._done(event["response"])
        elif kind == "error":
            error = event["error"]
            return [SessionError(self._turn, "gateway", str(error.get("code")), error["message"], True)]
        return []

    def _done(self, response: dict[str, Any]) -> list[Event]:
        turn, self._turn, self._responding = self._turn, self._turn + 1, False
        text = response["output"][0]["content"][0].get("transcript") or "" if response["output"] else ""
        ended: Event = Interrupted(turn, text) if response["status"] == "cancelled" else ReplyDone(turn, text)
        usage = response.get("usage") or {}
        server = conversation_pb2.TurnMetrics(
            speech_end_capture_us=self._speech_end_us,
            prompt_tokens=usage.get("input_tokens", 0),
            completion_tokens=usage.get("output_tokens", 0),
            reply_gap_ms=round(self._gap_ms, 1),
        )
        return [ended, TurnMetrics(turn, server, self._first_audio_us)]

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while (pcm16 := await self._outbox.get()) is not None:
            if ws.closed:
                return
            audio = base64.b64encode(pcm16).decode()
            self._sent_us.append(epoch_us())
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        while self._responding and not ws.closed:  # the last reply plays out, then the connection ends
            await asyncio.sleep(0.05)
        await ws.close()
