"""The browser front doors (aiohttp): the page at /, WebRTC signalling at POST /api/offer, WebSocket at /api/ws.

Both doors run the same Session as gRPC Converse (`ConversationServicer.open_session`), so the session limit and
the histories are shared, and a page that loses WebRTC reopens its session over WebSocket with the same id and
the conversation goes on. WebRTC specifics (tracks, Opus, the data channel) live in gateway/webrtc.py.

WebSocket protocol, /api/ws:
  page -> gateway   text    first {"type": "start", "config": <SessionConfig as JSON>, "fallback": {...}?};
                            later {"type": "stop"}: the user is done; the last reply plays out, then the socket closes;
                            {"type": "report", "turn_index", "first_audio_received_us"}: the downlink (ClientReport)
                    binary  one 20 ms frame: 12-byte header <q capture_time_us><I seq> (little-endian, epoch us of
                            the page's clock, seq from 0 without gaps), then PCM16LE mono at input_sample_rate_hz
  gateway -> page   text    the Converse events as {"type": <event kind>, "turn_index": n, ...the event's fields},
                            e.g. {"type": "user_partial", "turn_index": 0, "text": "the child", "stable_prefix": ""}
                    binary  reply audio: 12-byte header <q sent_time_us><I turn_index>, then 20 ms of PCM16LE mono
                            at output_sample_rate_hz, paced at real time (a 100 ms lead) and dropped at once on barge-in
  Refusals: an {"type": "error", "code", "message", "recoverable": false} event, then a close with a reason:
  4400 bad request (config, frame size), 4403 origin not allowed, 4408 idle, 4409 continued on a newer connection,
  4429 gateway full, 1001 gateway shutting down. /api/offer refuses with an HTTP status and {"error": {...}}.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import grpc
from aiohttp import WSMsgType, web
from google.protobuf import json_format
from google.protobuf.message import Message

from gateway.session import FRAME_S, LEAD_FRAMES, Session
from gateway.webrtc import INPUT_RATE_HZ, WebRtcOptions, WebRtcPeer
from voicemesh.audio import samples_per_frame
from voicemesh.clients import epoch_us
from voicemesh.errors import RequestError, invalid
from voicemesh.frames import FrameChecker
from voicemesh.v1 import audio_pb2, conversation_pb2

if TYPE_CHECKING:
    from gateway.server import ConversationServicer, GatewaySettings

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
FRAME_HEADER = struct.Struct("<qI")  # up: capture_time_us, seq; down: sent_time_us, turn_index
MAX_MESSAGE_BYTES = 64 * 1024  # a start message with a long system prompt fits; audio frames are ~2 KB
START_TIMEOUT_S = 10.0
CLOSE_DRAIN_S = 10.0  # the session already played its reply out; this bounds a stuck socket
CLOSE_REASON_BYTES = 123  # the WebSocket limit; the full message goes in the error event before the close

CLOSE_OK = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_BAD_REQUEST = 4400
CLOSE_UNAUTHENTICATED = 4401
CLOSE_ORIGIN = 4403
CLOSE_IDLE = 4408
CLOSE_TAKEN_OVER = 4409
CLOSE_FULL = 4429
CLOSE_CODES = {
    grpc.StatusCode.UNAUTHENTICATED: CLOSE_UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: CLOSE_ORIGIN,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CLOSE_FULL,
    grpc.StatusCode.DEADLINE_EXCEEDED: CLOSE_IDLE,
}
HTTP_STATUS = {
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
}


class OriginPolicy:
    """Which pages may open sessions: the gateway's own origin, plus a configured list ("*" = any)."""

    def __init__(self, allowed_origins: str) -> None:
        self.allowed = {origin.strip().rstrip("/").lower() for origin in allowed_origins.split(",") if origin.strip()}

    def check(self, origin: str | None, host: str) -> None:
        """Raises PERMISSION_DENIED for a foreign page. No Origin header means no browser, so no page to forge."""
        if origin is None or "*" in self.allowed:
            return
        if urlsplit(origin).netloc.lower() == host.lower() or origin.rstrip("/").lower() in self.allowed:
            return
        raise RequestError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"pages from {origin} may not open sessions on this gateway; its operator can allow them with "
            "--allowed-origins",
        )


def parse_uplink_frame(data: bytes, rate_hz: int) -> tuple[int, int, bytes]:
    """One binary WebSocket message -> (capture_time_us, seq, PCM16LE); raises RequestError unless 20 ms."""
    expected = samples_per_frame(rate_hz) * 2
    if len(data) != FRAME_HEADER.size + expected:
        raise invalid(
            f"audio message of {len(data)} bytes ({max(0, len(data) - FRAME_HEADER.size)} bytes of audio); send a "
            f"{FRAME_HEADER.size}-byte header (capture_time_us, seq) and 20 ms of PCM16LE mono at {rate_hz} Hz "
            f"({expected} bytes)"
        )
    capture_us, seq = FRAME_HEADER.unpack_from(data)
    return capture_us, seq, data[FRAME_HEADER.size :]


def event_message(event: conversation_pb2.ConverseEvent) -> dict[str, Any]:
    """A Converse event as the page's JSON: its kind, its turn, its fields (every field, defaults included)."""
    kind = event.WhichOneof("event")
    fields = _plain(getattr(event, kind)) if kind else {}
    return {"type": kind or "unknown", "turn_index": event.turn_index, **fields}


def _plain(message: Message) -> dict[str, Any]:
    # Not json_format: it writes int64 as strings, and epoch microseconds fit a JavaScript number exactly.
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            value = [_plain(v) for v in value] if field.is_repeated else _plain(value)
        elif field.is_repeated:
            value = list(value)
        out[field.name] = value
    return out


def error_message(error: RequestError, recoverable: bool = False) -> dict[str, Any]:
    return {"type": "error", "code": error.code.name, "message": error.message, "recoverable": recoverable}


class Transport(Protocol):
    """What a browser door gives its session: a way to send events and reply audio, and to close with a reason."""

    async def send_json(self, message: dict[str, Any]) -> None: ...

    async def send_audio(self, pcm16: bytes, turn_index: int) -> None: ...

    def flush_audio(self) -> int:
        """Drop reply audio not yet played out (barge-in); returns the frames dropped."""
        ...

    async def close(self, code: int, reason: str) -> None: ...


class BrowserSession:
    """A Session as a browser door runs it: checked input frames in, events out to a transport, idle timeout."""

    def __init__(self, servicer: ConversationServicer, session: Session, idle_timeout_s: float, door: str) -> None:
        self.servicer = servicer
        self.session = session
        self.session_id = session.options.session_id
        self.idle_timeout_s = idle_timeout_s
        self.door = door
        self.checker = FrameChecker(session.options.input_rate_hz)
        self.last_audio_s = time.monotonic()
        self.stopping = False
        self.flushed_frames = 0
        self._transport: Transport | None = None
        self._shutdown = asyncio.Event()
        self._finishing: asyncio.Task[None] | None = None

    @property
    def current(self) -> bool:
        """Still the gateway's session for its id (not ended, not taken over by a newer connection)."""
        return self.servicer.active.get(self.session_id) is self.session

    def push_audio(self, pcm16: bytes, capture_time_us: int, seq: int | None = None) -> None:
        """One 20 ms frame from the page; raises RequestError for a bad frame. Dropped after a stop."""
        if self.stopping:
            return
        frame = audio_pb2.AudioFrame(
            data=pcm16,
            encoding=audio_pb2.AUDIO_ENCODING_PCM16LE,
            sample_rate_hz=self.session.options.input_rate_hz,
            seq=self.checker.frames if seq is None else seq,
            capture_time_us=capture_time_us,
        )
        self.checker.check(frame)
        self.last_audio_s = time.monotonic()
        self.session.push_frame(frame)

    async def control(self, message: object) -> None:
        """A JSON control message from the page (after the start)."""
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "stop":
            await self.stop()
            return
        if kind == "report" and isinstance(message, dict):
            fields = {k: v for k, v in message.items() if k != "type"}
            try:
                self.session.on_client_report(json_format.ParseDict(fields, conversation_pb2.ClientReport()))
                return
            except json_format.ParseError as error:
                problem = invalid(f"report is not a ClientReport: {error}")
        else:
            problem = invalid(f"control message type {kind!r} unknown; send 'stop' or 'report'")
        if self._transport is not None:
            await self._transport.send_json(error_message(problem, recoverable=True))

    async def stop(self) -> None:
        """The user is done: the last reply plays out, then the event stream ends (and `run` closes the door)."""
        if self.stopping or not self.current:
            return
        self.stopping = True
        self._finishing = asyncio.ensure_future(self.session.finish())

    def shutdown(self) -> None:
        """The gateway is stopping: close the page's connection (it may reconnect elsewhere with its id)."""
        self._shutdown.set()

    async def run(self, transport: Transport, reader: Awaitable[None]) -> None:
        """Forward events until the session ends, is taken over, idles out or the page goes; then close the door
        with the reason and end the session.

        `reader` consumes the page's side; it returns when the page left (or, after a stop, when the reply played
        out) and raises RequestError for bad input.
        """
        self._transport = transport
        code, reason = CLOSE_GOING_AWAY, "the gateway ended the session"
        try:
            code, reason = await self._pump(transport, reader)
        finally:
            try:
                await transport.close(code, reason)
            finally:
                await self.servicer.end_session(self.session)
                log.info(
                    "browser session ended",
                    extra={"session_id": self.session_id, "door": self.door, "frames": self.checker.frames},
                )

    async def _pump(self, transport: Transport, reader: Awaitable[None]) -> tuple[int, str]:
        """Returns the close code and reason."""
        tasks = {
            "reader": asyncio.ensure_future(reader),
            "idle": asyncio.ensure_future(self._idle()),
            "shutdown": asyncio.ensure_future(self._shutdown.wait()),
        }
        getter: asyncio.Future[object] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(self.session.events.get())
                await asyncio.wait({getter, *tasks.values()}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    event = getter.result()
                    if event is None:
                        if self.current:
                            return CLOSE_OK, "the conversation ended"
                        transport.flush_audio()
                        return CLOSE_TAKEN_OVER, "this conversation continues on a newer connection"
                    if isinstance(event, RequestError):
                        return await self._refuse(transport, event)
                    assert isinstance(event, conversation_pb2.ConverseEvent)
                    await self._forward(transport, event)
                    continue
                getter.cancel()
                if tasks["shutdown"].done():
                    transport.flush_audio()
                    return CLOSE_GOING_AWAY, "the gateway is shutting down; reconnect to continue"
                if tasks["idle"].done():
                    return await self._refuse(transport, tasks["idle"].result())
                try:
                    tasks["reader"].result()
                except RequestError as error:
                    return await self._refuse(transport, error)
                if not self.stopping:
                    transport.flush_audio()
                    return CLOSE_GOING_AWAY, "the page went away"
                tasks["reader"] = asyncio.ensure_future(asyncio.Event().wait())  # drain the events to their end
        finally:
            if getter is not None:
                getter.cancel()
            if self._finishing is not None:
                tasks["finishing"] = self._finishing
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _forward(self, transport: Transport, event: conversation_pb2.ConverseEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "reply_audio":
            await transport.send_audio(event.reply_audio.frame.data, event.turn_index)
            return
        if kind == "interrupted":
            dropped = transport.flush_audio()  # before the event: nothing of the old reply may follow it
            self.flushed_frames += dropped
            log.info("barge-in flush", extra={"session_id": self.session_id, "door": self.door, "dropped": dropped})
        await transport.send_json(event_message(event))

    async def _refuse(self, transport: Transport, error: RequestError) -> tuple[int, str]:
        log.info(
            "browser session refused",
            extra={"session_id": self.session_id, "door": self.door, "code": error.code.name, "reason": error.message},
        )
        transport.flush_audio()
        await transport.send_json(error_message(error))
        return CLOSE_CODES.get(error.code, CLOSE_BAD_REQUEST), error.message

    async def _idle(self) -> RequestError:
        while True:
            silent_s = time.monotonic() - self.last_audio_s
            if silent_s >= self.idle_timeout_s and not self.stopping:
                return RequestError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no audio for {self.idle_timeout_s:g} s, so the session was closed; start again to continue "
                    "(the conversation is remembered)",
                )
            await asyncio.sleep(max(0.05, min(1.0, self.idle_timeout_s - silent_s)))


class PacedDownlink:
    """The WebSocket's send queue: reply audio at real-time pace (the first LEAD_FRAMES at once), other messages
    in order between the frames, and `flush` drops the audio not yet sent (barge-in) at once."""

    def __init__(
        self,
        send: Callable[[str, Any], Awaitable[None]],
        frame_s: float = FRAME_S,
        lead_frames: int = LEAD_FRAMES,
    ) -> None:
        self._send = send
        self._frame_s = frame_s
        self._lead_s = lead_frames * frame_s
        self._items: collections.deque[tuple[str, Any]] = collections.deque()
        self._ready = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self._flushed = asyncio.Event()
        self._next_due: float | None = None

    @property
    def queued_audio(self) -> int:
        return sum(1 for kind, _ in self._items if kind == "audio")

    def push(self, kind: str, payload: Any) -> None:
        """Queue a message: kind "audio" (paced) or anything else (sent as soon as it is at the front)."""
        self._items.append((kind, payload))
        self._empty.clear()
        self._ready.set()

    def flush(self) -> int:
        kept = collections.deque(item for item in self._items if item[0] != "audio")
        dropped = len(self._items) - len(kept)
        self._items = kept
        self._next_due = None  # the next reply starts with a fresh lead
        self._flushed.set()  # wake the sender if it waits for a frame's turn
        if not kept:
            self._empty.set()
        return dropped

    async def drain(self) -> None:
        """Wait until everything queued has been sent (audio at its pace)."""
        await self._empty.wait()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._items:
                kind, payload = self._items[0]
                if kind == "audio":
                    now = time.monotonic()
                    if self._next_due is None or self._next_due < now - self._lead_s:
                        self._next_due = now - self._lead_s
                    if self._next_due > now:
                        self._flushed.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._flushed.wait(), self._next_due - now)
                        continue  # the frame's turn came, or a flush changed the queue
                    self._next_due += self._frame_s
                self._items.popleft()
                await self._send(kind, payload)
            self._empty.set()


class WebSocketTransport:
    """Events as text and reply audio as binary frames (header + PCM16) over one WebSocket, paced."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws
        self.downlink = PacedDownlink(self._write)
        self._sender = asyncio.ensure_future(self.downlink.run())

    async def _write(self, kind: str, payload: Any) -> None:
        if self.ws.closed:
            return
        if kind == "audio":
            turn_index, pcm16 = payload
            # Stamped as the frame leaves, so the page's downlink measure includes the pacing.
            await self.ws.send_bytes(FRAME_HEADER.pack(epoch_us(), turn_index) + pcm16)
        else:
            await self.ws.send_str(payload)

    async def send_json(self, message: dict[str, Any]) -> None:
        self.downlink.push("text", json.dumps(message))

    async def send_audio(self, pcm16: bytes, turn_index: int) -> None:
        self.downlink.push("audio", (turn_index, pcm16))

    def flush_audio(self) -> int:
        return self.downlink.flush()

    async def close(self, code: int, reason: str) -> None:
        # What is queued goes out first (audio at its pace: a finished reply plays to its end).
        if not self.ws.closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.downlink.drain(), CLOSE_DRAIN_S)
        self._sender.cancel()
        await asyncio.gather(self._sender, return_exceptions=True)
        await self.ws.close(code=code, message=reason.encode()[:CLOSE_REASON_BYTES])


async def refuse_websocket(ws: web.WebSocketResponse, error: RequestError) -> None:
    """Refuse before any session exists: the error event, then the close with its code."""
    await ws.send_str(json.dumps(error_message(error)))
    await ws.close(
        code=CLOSE_CODES.get(error.code, CLOSE_BAD_REQUEST), message=error.message.encode()[:CLOSE_REASON_BYTES]
    )


class WebDoor:
    """The gateway's HTTP server: the page, its config, WebRTC offers and WebSocket sessions."""

    def __init__(self, servicer: ConversationServicer, settings: GatewaySettings) -> None:
        self.servicer = servicer
        self.settings = settings
        self.origins = OriginPolicy(settings.allowed_origins)
        self.webrtc = WebRtcOptions.from_settings(settings)
        self.webrtc.install()
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._browsers: set[BrowserSession] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_MESSAGE_BYTES)
        app.router.add_get("/", self._index)
        app.router.add_get("/api/config", self._config)
        app.router.add_post("/api/offer", self._offer)
        app.router.add_post("/api/ice-state", self._ice_state)
        app.router.add_get("/api/ws", self._websocket)
        app.router.add_static("/static/", STATIC_DIR)
        return app

    async def start(self, port: int) -> int:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.host, port)
        try:
            await site.start()
        except OSError as error:
            await runner.cleanup()
            raise SystemExit(f"cannot bind HTTP {self.settings.host}:{port}: {error.strerror}") from error
        self._runner = runner
        self.port = runner.addresses[0][1]
        log.info("browser doors listening", extra={"url": f"http://{self._page_host()}:{self.port}/"})
        return self.port

    def _page_host(self) -> str:
        return "localhost" if self.settings.host in ("127.0.0.1", "0.0.0.0", "::", "::1", "") else self.settings.host

    async def stop(self) -> None:
        for browser in list(self._browsers):
            browser.shutdown()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- handlers -----------------------------------------------------------------------------------------
    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def _config(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "ice_servers": self.webrtc.page_ice_servers,
                "webrtc_connect_timeout_s": self.settings.webrtc_connect_timeout_s,
                "idle_timeout_s": self.settings.idle_timeout_s,
                "frame_ms": round(FRAME_S * 1000),
                "input_sample_rates_hz": [16000, 48000],
            }
        )

    async def _ice_state(self, request: web.Request) -> web.Response:
        """The page reports its side's ICE state; logged next to the gateway's own."""
        try:
            self.origins.check(request.headers.get("Origin"), request.host)
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except RequestError as error:
            return _error_response(error)
        except ValueError:
            return _error_response(invalid("send JSON {session_id, state}"))
        log.info(
            "ICE state",
            extra={
                "session_id": str(body.get("session_id", ""))[:128],
                "side": "browser",
                "state": str(body.get("state")),
            },
        )
        return web.Response(status=204)

    async def _offer(self, request: web.Request) -> web.Response:
        """WebRTC signalling: the page's SDP offer in, the gateway's answer out (non-trickle ICE)."""
        try:
            self.origins.check(request.headers.get("Origin"), request.host)
            self.servicer.check_token(_authorization(request))
            try:
                body = await request.json()
            except ValueError as error:
                raise invalid(f"the offer is not JSON ({error}); send {{sdp, type: 'offer', config}}") from error
            if not isinstance(body, dict) or body.get("type") != "offer" or not isinstance(body.get("sdp"), str):
                raise invalid("send {sdp, type: 'offer', config}: an SDP offer of type 'offer'")
            session_config = _session_config(body.get("config"))
            session_config.input_sample_rate_hz = INPUT_RATE_HZ  # the mic track is decoded from Opus at 48 kHz
            session = await self.servicer.open_session(session_config, door="webrtc")
        except RequestError as error:
            log.info("offer refused", extra={"code": error.code.name, "reason": error.message})
            return _error_response(error)
        browser = BrowserSession(self.servicer, session, self.settings.idle_timeout_s, "webrtc")
        peer = WebRtcPeer(self.webrtc, browser)
        try:
            answer = await peer.answer(body["sdp"])
        except ValueError as error:
            await peer.close(CLOSE_BAD_REQUEST, "the offer was not understood")
            await self.servicer.end_session(session)
            return _error_response(invalid(f"the SDP offer was not understood: {error}"))
        self._spawn(self._run(browser, peer, peer.input_ended()))
        return web.json_response({"sdp": answer.sdp, "type": answer.type, "session_id": browser.session_id})

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        # No per-message deflate: PCM barely compresses and zlib on every 20 ms frame costs CPU and latency.
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=20.0, compress=False)
        await ws.prepare(request)
        try:
            self.origins.check(request.headers.get("Origin"), request.host)
            self.servicer.check_token(_authorization(request))
            start = await _start_message(ws)
            session = await self.servicer.open_session(_session_config(start.get("config")), door="websocket")
        except RequestError as error:
            log.info("websocket refused", extra={"code": error.code.name, "reason": error.message})
            await refuse_websocket(ws, error)
            return ws
        browser = BrowserSession(self.servicer, session, self.settings.idle_timeout_s, "websocket")
        fallback = start.get("fallback")
        if fallback:
            log.info("moved from WebRTC to WebSocket", extra={"session_id": browser.session_id, "fallback": fallback})
        await self._spawn(self._run(browser, WebSocketTransport(ws), _read_websocket(ws, browser)))
        return ws

    def _spawn(self, coroutine: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run(self, browser: BrowserSession, transport: Transport, reader: Awaitable[None]) -> None:
        self._browsers.add(browser)
        try:
            await browser.run(transport, reader)
        except Exception:
            log.exception("browser session failed", extra={"session_id": browser.session_id, "door": browser.door})
        finally:
            self._browsers.discard(browser)


def _authorization(request: web.Request) -> str:
    """The `Authorization` header, or `?token=` (a browser cannot set headers on a WebSocket)."""
    token = request.query.get("token")
    return f"Bearer {token}" if token else request.headers.get("Authorization", "")


def _error_response(error: RequestError) -> web.Response:
    return web.json_response(
        {"error": {"code": error.code.name, "message": error.message}}, status=HTTP_STATUS.get(error.code, 400)
    )


def _session_config(raw: object) -> conversation_pb2.SessionConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise invalid("config must be a JSON object (a SessionConfig)")
    try:
        return json_format.ParseDict(raw, conversation_pb2.SessionConfig())
    except json_format.ParseError as error:
        raise invalid(f"config is not a SessionConfig: {error}") from error


async def _start_message(ws: web.WebSocketResponse) -> dict[str, Any]:
    try:
        message = await ws.receive(timeout=START_TIMEOUT_S)
    except TimeoutError as error:
        raise invalid(f"no start message within {START_TIMEOUT_S:g} s") from error
    if message.type != WSMsgType.TEXT:
        raise invalid('the first message must be JSON {"type": "start", "config": {...}}, before any audio')
    try:
        start = json.loads(message.data)
    except ValueError as error:
        raise invalid(f"the start message is not JSON: {error}") from error
    if not isinstance(start, dict) or start.get("type") != "start":
        raise invalid('the first message must be JSON {"type": "start", "config": {...}}')
    return start


async def _read_websocket(ws: web.WebSocketResponse, browser: BrowserSession) -> None:
    rate_hz = browser.session.options.input_rate_hz
    async for message in ws:
        if message.type == WSMsgType.BINARY:
            capture_us, seq, pcm16 = parse_uplink_frame(message.data, rate_hz)
            browser.push_audio(pcm16, capture_us, seq)
        elif message.type == WSMsgType.TEXT:
            try:
                control = json.loads(message.data)
            except ValueError as error:
                raise invalid(f"a text message is not JSON: {error}") from error
            await browser.control(control)
