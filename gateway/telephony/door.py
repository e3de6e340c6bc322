"""The telephony door's HTTP side: each carrier's voice webhook (verified, answered with its XML pointing the call's
audio at the door's WebSocket and handing it a one-use token) and that WebSocket, whose `start` must carry the token
before a session opens."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

from aiohttp import web

from gateway.browser import BrowserSession, Transport
from gateway.protocol import close_code, close_reason, session_config
from gateway.registry import SessionRegistry
from gateway.settings import GatewaySettings
from gateway.telephony.carrier import Connected, MediaStream, Start, Webhook
from gateway.telephony.line import PhoneLine, decode_message, read_call
from gateway.telephony.signatures import telnyx_public_key
from gateway.telephony.telnyx import Telnyx
from gateway.telephony.tokens import StreamTokens
from gateway.telephony.twilio import Twilio
from voicemesh.auth import Principal
from voicemesh.errors import RequestError, invalid
from voicemesh.v1 import conversation_pb2

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
MAX_WEBHOOK_BYTES = 64 * 1024
MAX_STREAM_MESSAGE_BYTES = 64 * 1024  # 20 ms of G.711 is 216 bytes of base64; a carrier sends at most 1 s at once
PHONE_RATE_HZ = 8000

Serve = Callable[[BrowserSession, Transport, Awaitable[None]], Awaitable[None]]


def carriers(settings: GatewaySettings) -> dict[str, MediaStream]:
    """The carriers this gateway answers, by path name: each one whose credential is set."""
    enabled: dict[str, MediaStream] = {}
    if settings.twilio_auth_token:
        enabled["twilio"] = Twilio(settings.twilio_auth_token)
    if settings.telnyx_public_key:
        enabled["telnyx"] = Telnyx(telnyx_public_key(settings.telnyx_public_key))
    return enabled


class TelephonyDoor:
    """POST /telephony/<carrier>/voice and GET /telephony/<carrier>/stream for each carrier that is set up."""

    def __init__(self, registry: SessionRegistry, settings: GatewaySettings, serve: Serve) -> None:
        self.registry = registry
        self.settings = settings
        self.carriers = carriers(settings)
        self.tokens = StreamTokens(settings.telephony_stream_secret, settings.telephony_token_ttl_s)
        try:
            self.config = session_config(json.loads(settings.telephony_config))
        except (ValueError, RequestError) as error:
            raise SystemExit(f"telephony_config is not a SessionConfig as JSON: {error}") from error
        self.config.input_sample_rate_hz = self.config.output_sample_rate_hz = PHONE_RATE_HZ
        self._serve = serve

    def add_routes(self, app: web.Application) -> None:
        for path_name, carrier in self.carriers.items():
            app.router.add_post(f"/telephony/{path_name}/voice", self._webhook_handler(path_name, carrier))
            app.router.add_get(f"/telephony/{path_name}/stream", self._stream_handler(path_name, carrier))

    def _public_url(self, request: web.Request) -> str:
        """The URL the carrier requested: the configured public base (a proxy in front) or the request's own."""
        base = self.settings.telephony_public_url.rstrip("/")
        return f"{base}{request.path_qs}" if base else str(request.url)

    def _stream_url(self, request: web.Request, path_name: str) -> str:
        base = self.settings.telephony_public_url.rstrip("/") or f"{request.scheme}://{request.host}"
        return base.replace("https://", "wss://", 1).replace("http://", "ws://", 1) + f"/telephony/{path_name}/stream"

    def _webhook_handler(
        self, path_name: str, carrier: MediaStream
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            body = await request.content.read(MAX_WEBHOOK_BYTES + 1)
            form = parse_qs(body.decode(errors="replace"), keep_blank_values=True)
            webhook = Webhook(self._public_url(request), request.headers, body, form)
            try:
                if len(body) > MAX_WEBHOOK_BYTES:
                    raise invalid(f"webhook body over {MAX_WEBHOOK_BYTES} bytes")
                carrier.verify(webhook)
                call_id = carrier.call_id(webhook)
            except RequestError as error:
                log.info(
                    "webhook refused", extra={"carrier": path_name, "code": error.code.name, "reason": error.message}
                )
                return web.Response(status=403 if error.code.name == "PERMISSION_DENIED" else 400, text=error.message)
            token = self.tokens.issue(path_name, call_id)
            answer = carrier.answer(self._stream_url(request, path_name), token)
            return web.Response(text=answer, content_type="application/xml")

        return handle

    def _stream_handler(
        self, path_name: str, carrier: MediaStream
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            ws = web.WebSocketResponse(max_msg_size=MAX_STREAM_MESSAGE_BYTES, heartbeat=20.0, compress=False)
            await ws.prepare(request)
            try:
                start = await self._start(ws, carrier)
                self.tokens.redeem(start.token, path_name, start.call_id)
                principal = Principal(f"{path_name}:{start.call_id}")
                self.registry.admit(principal, request.remote or "")
                config = conversation_pb2.SessionConfig()
                config.CopyFrom(self.config)
                config.session_id = f"{path_name}-{start.call_id}"[:128]
                session = await self.registry.open_session(config, door=path_name, principal=principal)
            except RequestError as error:
                log.info(
                    "phone stream refused",
                    extra={"carrier": path_name, "code": error.code.name, "reason": error.message},
                )
                await ws.close(code=close_code(error), message=close_reason(error.message))
                return ws
            browser = BrowserSession(self.registry, session, self.settings.idle_timeout_s, path_name)
            line = PhoneLine(ws, carrier, start, session, browser.downlink)
            log.info("phone call started", extra={"session_id": browser.session_id, "carrier": path_name})
            await self._serve(browser, line, read_call(ws, line, browser))
            log.info(
                "phone call ended",
                extra={
                    "session_id": browser.session_id,
                    "media_sent": line.media_sent,
                    "gaps_filled": line.audio.order.filled,
                    "late_chunks": line.audio.order.late,
                },
            )
            return ws

        return handle

    async def _start(self, ws: web.WebSocketResponse, carrier: MediaStream) -> Start:
        """The carrier's `start` (after an optional `connected`); RequestError for anything else first."""
        while True:
            try:
                message = await ws.receive(timeout=START_TIMEOUT_S)
            except TimeoutError:
                raise invalid(f"no start message within {START_TIMEOUT_S:g} s") from None
            decoded = decode_message(message, carrier)
            event = carrier.parse(decoded)
            if isinstance(event, Start):
                return event
            if not isinstance(event, Connected):
                raise invalid(f"a {decoded.get('event')!r} message before the start; the stream begins with start")
