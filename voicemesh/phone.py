"""A phone call as a carrier places it on the gateway's telephony door, message for message as Twilio's Media Streams
and Telnyx's media streaming documents define them: the signed voice webhook, then the stream (connected, start,
media, dtmf, stop in; media, mark, clear back), with the carrier's playback emulated (a mark comes back once the audio
before it has played at real time; `clear` drops what is queued and returns its marks at once). For tests, the
benchmarks and `voicemesh loadtest --transport twilio`."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode
from xml.etree import ElementTree

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from voicemesh import g711
from voicemesh.audio import Clip
from voicemesh.carrier_signatures import telnyx_signed_message, twilio_signature
from voicemesh.clients import Pacer, epoch_us

PHONE_RATE_HZ = 8000
CHUNK_BYTES = 160  # 20 ms of G.711 at 8 kHz, as both carriers send it


class CallRefused(Exception):
    """The door refused the webhook (HTTP status) or closed the stream (WebSocket close code)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Carrier:
    """Which carrier to play and its account's credential: Twilio's auth token, or Telnyx's signing key."""

    kind: str  # "twilio" or "telnyx"
    auth_token: str = ""
    signing_key: Ed25519PrivateKey | None = None
    encoding: str = "PCMU"  # Telnyx may stream PCMA; Twilio always μ-law


@dataclass(frozen=True)
class Heard:
    """One thing the door sent the carrier, as it arrived: "media" (its PCM16), "mark" (its name) or "clear"."""

    kind: str
    at_us: int
    pcm16: bytes = b""
    name: str = ""


@dataclass
class PhoneCall:
    """One call. `dial`, then `send` 20 ms of 8 kHz PCM16 at a time (paced by the caller), `dtmf`, and `hang_up` (a
    stop) or `drop` (the socket cut); `received` is everything the door sent, in order."""

    target: str
    """The gateway's HTTP door, HOST:PORT."""
    carrier: Carrier
    call_id: str = field(default_factory=lambda: "CA" + secrets.token_hex(16))
    echo_marks: bool = True
    """Echo each mark once its audio played; False plays a carrier that never does."""
    received: list[Heard] = field(default_factory=list)
    echoed: list[Heard] = field(default_factory=list)
    """The marks this carrier sent back, as it sent them (cleared ones too: a carrier returns those on `clear`)."""
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    close_code: int | None = None
    _http: aiohttp.ClientSession | None = None
    _ws: aiohttp.ClientWebSocketResponse | None = None
    _reader: asyncio.Task[None] | None = None
    _sequence: int = 0
    _chunk: int = 0
    _play_end_s: float = 0.0
    _pending_marks: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    _echoes: set[asyncio.Task[None]] = field(default_factory=set)
    stream_id: str = field(default_factory=lambda: "MZ" + secrets.token_hex(16))

    @property
    def marks_pending(self) -> int:
        """Marks received whose audio has not played yet (not echoed yet)."""
        return len(self._pending_marks)

    @property
    def session_id(self) -> str:
        """The gateway's session for this call."""
        return f"{self.carrier.kind}-{self.call_id}"

    # ---- the webhook ------------------------------------------------------------------------------------------
    async def webhook(self, url: str | None = None, tamper: bool = False) -> tuple[str, str]:
        """POST the signed voice webhook; returns the stream URL and token from the answer. CallRefused if refused."""
        url = url or f"http://{self.target}/telephony/{self.carrier.kind}/voice"
        form = {
            "AccountSid": "AC" + "0" * 32,
            "CallSid": self.call_id,
            "CallStatus": "ringing",
            "Direction": "inbound",
            "From": "+15550001111",
            "To": "+15550002222",
        }
        body = urlencode(form).encode()
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        if self.carrier.kind == "twilio":
            signed = {name: [value] for name, value in form.items()}
            headers["X-Twilio-Signature"] = twilio_signature(self.carrier.auth_token, url, signed)
        else:
            assert self.carrier.signing_key is not None, "a Telnyx carrier signs with its Ed25519 key"
            timestamp = str(int(time.time()))
            signature = self.carrier.signing_key.sign(telnyx_signed_message(timestamp, body))
            headers.update(
                {"telnyx-timestamp": timestamp, "telnyx-signature-ed25519": base64.b64encode(signature).decode()}
            )
        if tamper:
            body = body.replace(b"ringing", b"ringinG")
        async with self._session().post(url, data=body, headers=headers) as response:
            text = await response.text()
            if response.status != 200:
                raise CallRefused(response.status, text)
        stream = ElementTree.fromstring(text).find("./Connect/Stream")
        if stream is None:
            raise CallRefused(200, f"no <Connect><Stream> in the answer: {text[:200]}")
        token = next((p.get("value", "") for p in stream.findall("Parameter") if p.get("name") == "token"), "")
        return stream.get("url", ""), token

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    # ---- the stream -------------------------------------------------------------------------------------------
    async def dial(self) -> None:
        """The webhook, then the stream with its connected and start messages."""
        url, token = await self.webhook()
        await self.open_stream(url, token)

    async def open_stream(self, url: str, token: str, start: bool = True) -> None:
        """Connect to the stream URL and greet (`connected`), then `start` with `token` unless told not to."""
        self._ws = await self._session().ws_connect(url, timeout=aiohttp.ClientWSTimeout(ws_receive=None))
        self._reader = asyncio.ensure_future(self._read())
        await self.send_message(self._connected())
        if start:
            await self.send_message(self.start_message(token))

    async def send_message(self, message: dict[str, Any] | str) -> None:
        """Any message as it is (a test sends bad ones too); False if the socket is closed."""
        assert self._ws is not None, "dial first"
        if not self._ws.closed:
            await self._ws.send_str(message if isinstance(message, str) else json.dumps(message))

    async def send(self, pcm16: bytes, chunk: int | None = None) -> None:
        """One chunk of the caller's audio (8 kHz PCM16), encoded as the carrier's codec; `chunk` overrides its number
        (to send chunks out of order or skip one)."""
        encode = g711.alaw_encode if self.carrier.encoding == "PCMA" else g711.ulaw_encode
        self._chunk = self._chunk + 1 if chunk is None else max(self._chunk, chunk)
        await self.send_message(self._media(encode(pcm16), self._chunk if chunk is None else chunk))

    async def speak(
        self, clip: Clip, then_silence_s: float = 0.0, until: Callable[[], bool] | None = None
    ) -> list[int]:
        """Say `clip` (resampled to 8 kHz) at real-time pace, then silence for `then_silence_s` or until `until()`
        holds; returns the epoch microseconds each of the clip's 20 ms frames was sent at."""
        pacer = Pacer()
        sent_us = []
        for frame in clip.to_rate(PHONE_RATE_HZ).frames():
            await pacer.wait()
            sent_us.append(epoch_us())
            await self.send(frame)
        silence = bytes(CHUNK_BYTES * 2)
        deadline_s = time.monotonic() + then_silence_s
        while time.monotonic() < deadline_s and not (until is not None and until()) and not self.closed.is_set():
            await pacer.wait()
            await self.send(silence)
        return sent_us

    async def dtmf(self, digit: str) -> None:
        await self.send_message(self._dtmf(digit))

    async def hang_up(self) -> None:
        """The call ends: stop, then the socket closes."""
        await self.send_message(self._stop())
        await self.close()

    async def drop(self) -> None:
        """The connection is cut: no stop, no close handshake."""
        if self._ws is not None:
            transport = getattr(getattr(self._ws, "_writer", None), "transport", None)
            if transport is not None:
                transport.abort()
        await self.close()

    async def close(self) -> None:
        for handle in self._pending_marks.values():
            handle.cancel()
        await asyncio.gather(*self._echoes, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> PhoneCall:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- what the door sends, and the carrier's playback ---------------------------------------------------
    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for message in self._ws:
                if message.type == aiohttp.WSMsgType.TEXT:
                    self._on_message(json.loads(message.data))
        finally:
            self.close_code = self._ws.close_code
            self.closed.set()

    def _on_message(self, message: dict[str, Any]) -> None:
        now_s = time.monotonic()
        event = message.get("event")
        if event == "media":
            payload = base64.b64decode(message["media"]["payload"])
            decode = g711.alaw_decode if self.carrier.encoding == "PCMA" else g711.ulaw_decode
            self.received.append(Heard("media", epoch_us(), pcm16=decode(payload)))
            self._play_end_s = max(now_s, self._play_end_s) + len(payload) / PHONE_RATE_HZ
        elif event == "mark":
            name = message["mark"]["name"]
            self.received.append(Heard("mark", epoch_us(), name=name))
            if self.echo_marks:
                delay_s = max(0.0, self._play_end_s - now_s)
                self._pending_marks[name] = asyncio.get_running_loop().call_later(delay_s, self._echo, name)
        elif event == "clear":
            self.received.append(Heard("clear", epoch_us()))
            self._play_end_s = now_s
            for name, handle in list(self._pending_marks.items()):  # the carrier returns the cleared marks at once
                handle.cancel()
                self._echo(name)

    def _echo(self, name: str) -> None:
        self._pending_marks.pop(name, None)
        if self._ws is not None and not self._ws.closed:
            self.echoed.append(Heard("mark", epoch_us(), name=name))
            echo = asyncio.ensure_future(self.send_message(self._mark(name)))
            self._echoes.add(echo)
            echo.add_done_callback(self._echoes.discard)

    # ---- the carriers' messages -----------------------------------------------------------------------------
    def _next_sequence(self) -> str:
        self._sequence += 1
        return str(self._sequence)

    def _envelope(self, event: str, **fields: Any) -> dict[str, Any]:
        if self.carrier.kind == "twilio":
            return {"event": event, "sequenceNumber": self._next_sequence(), **fields, "streamSid": self.stream_id}
        return {"event": event, "sequence_number": self._next_sequence(), **fields, "stream_id": self.stream_id}

    def _connected(self) -> dict[str, Any]:
        if self.carrier.kind == "twilio":
            return {"event": "connected", "protocol": "Call", "version": "1.0.0"}
        return {"event": "connected", "version": "1.0.0"}

    def start_message(self, token: str) -> dict[str, Any]:
        if self.carrier.kind == "twilio":
            start = {
                "accountSid": "AC" + "0" * 32,
                "streamSid": self.stream_id,
                "callSid": self.call_id,
                "tracks": ["inbound"],
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": PHONE_RATE_HZ, "channels": 1},
                "customParameters": {"token": token},
            }
        else:
            start = {
                "user_id": "3E6F995F-85F7-4705-9741-53B116D28237",
                "call_control_id": self.call_id,
                "call_session_id": "ff55a038-6f5d-11ef-9692-02420aeffb1f",
                "from": "+15550001111",
                "to": "+15550002222",
                "custom_parameters": {"token": token},
                "media_format": {"encoding": self.carrier.encoding, "sample_rate": PHONE_RATE_HZ, "channels": 1},
            }
        return self._envelope("start", start=start)

    def _media(self, payload: bytes, chunk: int) -> dict[str, Any]:
        media = {
            "track": "inbound",
            "chunk": str(chunk),
            "timestamp": str((chunk - 1) * 20),
            "payload": base64.b64encode(payload).decode(),
        }
        return self._envelope("media", media=media)

    def _dtmf(self, digit: str) -> dict[str, Any]:
        track = {"track": "inbound_track"} if self.carrier.kind == "twilio" else {}
        return self._envelope("dtmf", dtmf={**track, "digit": digit})

    def _mark(self, name: str) -> dict[str, Any]:
        return self._envelope("mark", mark={"name": name})

    def _stop(self) -> dict[str, Any]:
        if self.carrier.kind == "twilio":
            return self._envelope("stop", stop={"accountSid": "AC" + "0" * 32, "callSid": self.call_id})
        return self._envelope("stop", stop={"user_id": "3E6F995F", "call_control_id": self.call_id})

    # ---- what a test reads of it ---------------------------------------------------------------------------
    def media_after(self, at_us: int) -> list[Heard]:
        return [heard for heard in self.received if heard.kind == "media" and heard.at_us > at_us]
