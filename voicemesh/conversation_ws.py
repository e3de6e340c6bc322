"""Async client for the gateway's WebSocket door (/api/ws): the protocol a browser page speaks (see
gateway/protocol.py), with the same interface and typed events as `ConversationClient`, so a load test can drive
the door browsers use."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from google.protobuf import json_format

from voicemesh.clients import PLAINTEXT, Credentials, epoch_us
from voicemesh.conversation import ConversationFailed, Event, ReplyAudio, Started, event_from
from voicemesh.v1 import conversation_pb2

FRAME_HEADER = struct.Struct("<qI")  # up: capture_time_us, seq; down: sent_time_us, turn_index
CLOSE_OK = 1000
CONNECT_TIMEOUT_S = 10.0


@dataclass
class WebSocketConversationClient:
    """One conversation over /api/ws. `send` audio, iterate `events()`; `close` ends the user's side (the last
    reply plays out, then the gateway closes). A refusal or a close with an error raises ConversationFailed
    with the gateway's status name. It does not reconnect: a load test counts a dropped session, never hides it.

    `target` is the gateway's HTTP door, HOST:PORT (wss:// when `credentials.tls` is set)."""

    target: str
    config: conversation_pb2.SessionConfig
    credentials: Credentials = PLAINTEXT
    _outbox: asyncio.Queue[bytes | str | None] = field(default_factory=asyncio.Queue)
    _seq: int = 0
    _first_audio_us: dict[int, int] = field(default_factory=dict)
    _frames: dict[int, int] = field(default_factory=dict)  # reply frames received per turn
    _http: aiohttp.ClientSession | None = None
    _closed: bool = False

    @property
    def url(self) -> str:
        return f"{'wss' if self.credentials.tls else 'ws'}://{self.target}/api/ws"

    async def __aenter__(self) -> WebSocketConversationClient:
        self._http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()

    def send(self, pcm16: bytes) -> None:
        """Queue one frame of PCM16 audio at the configured input rate (stamped with its capture time now)."""
        self._outbox.put_nowait(FRAME_HEADER.pack(epoch_us(), self._seq) + pcm16)
        self._seq += 1

    def close(self) -> None:
        """No more audio: the gateway finishes the last turn, then closes the socket."""
        if not self._closed:
            self._closed = True
            self._outbox.put_nowait(json.dumps({"type": "stop"}))
            self._outbox.put_nowait(None)

    async def events(self) -> AsyncIterator[Event]:
        assert self._http is not None, "use `async with WebSocketConversationClient(...)`"
        ssl = self.credentials.tls.ssl_context() if self.credentials.tls else None
        try:
            ws = await self._http.ws_connect(
                self.url, ssl=ssl if ssl is not None else True, timeout=aiohttp.ClientWSTimeout(ws_receive=None)
            )
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ConversationFailed("UNAVAILABLE", f"cannot open {self.url}: {error}") from error
        start: dict[str, object] = {
            "type": "start",
            "config": json_format.MessageToDict(self.config, preserving_proto_field_name=True),
        }
        if self.credentials.token:
            start["token"] = self.credentials.token
        await ws.send_str(json.dumps(start))
        writer = asyncio.ensure_future(self._write(ws))
        refusal: tuple[str, str] | None = None
        try:
            async for message in ws:
                if message.type == aiohttp.WSMsgType.BINARY:
                    yield self._reply_audio(message.data)
                elif message.type == aiohttp.WSMsgType.TEXT:
                    event = self._event(json.loads(message.data))
                    if event.WhichOneof("event") == "error" and not event.error.recoverable:
                        refusal = (event.error.code, event.error.message)
                    converted = event_from(event, self._first_audio_us)
                    if isinstance(converted, Started):
                        self.config.session_id = converted.session_id
                    yield converted
            code = ws.close_code or CLOSE_OK
            if code != CLOSE_OK or refusal is not None:
                status, details = refusal or (f"CLOSE_{code}", "the gateway closed the connection")
                raise ConversationFailed(status, details)
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await ws.close()

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while (item := await self._outbox.get()) is not None:
            if ws.closed:
                return
            if isinstance(item, bytes):
                await ws.send_bytes(item)
            else:
                await ws.send_str(item)

    def _event(self, data: dict[str, object]) -> conversation_pb2.ConverseEvent:
        """The page's JSON event, {"type": kind, "turn_index": n, ...fields}, back into a ConverseEvent."""
        kind = str(data.pop("type", ""))
        turn_index = data.pop("turn_index", 0)
        return json_format.ParseDict(
            {"turn_index": turn_index, kind: data}, conversation_pb2.ConverseEvent(), ignore_unknown_fields=True
        )

    def _reply_audio(self, data: bytes) -> ReplyAudio:
        sent_us, turn = FRAME_HEADER.unpack_from(data)
        now = epoch_us()
        if turn not in self._first_audio_us:
            self._first_audio_us[turn] = now
            if not self._closed:  # as the page does: the gateway records the downlink stage from it
                report = {"type": "report", "turn_index": turn, "first_audio_received_us": now}
                self._outbox.put_nowait(json.dumps(report))
        seq = self._frames.get(turn, 0)
        self._frames[turn] = seq + 1
        pcm16 = data[FRAME_HEADER.size :]
        return ReplyAudio(turn, pcm16, self.config.output_sample_rate_hz, "", sent_us, now, seq)
