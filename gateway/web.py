"""The gateway's HTTP server (aiohttp): the page at /, its config, WebRTC signalling at POST /api/offer and the
WebSocket at /api/ws.

Both browser doors run the same sessions as gRPC Converse (gateway/registry.py), so the session limit and the
histories are shared, and a page that loses WebRTC reopens its session over WebSocket with the same id and the
conversation goes on. The protocol is in gateway/protocol.py; the transports in gateway/websocket.py and
gateway/webrtc.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from pathlib import Path

import grpc
from aiohttp import web

from gateway.browser import BrowserSession, Transport
from gateway.origins import OriginPolicy
from gateway.protocol import CLOSE_BAD_REQUEST, MAX_MESSAGE_BYTES, session_config
from gateway.realtime.door import RealtimeDoor
from gateway.registry import RateLimited, SessionRegistry
from gateway.settings import GatewaySettings
from gateway.telephony.door import TelephonyDoor
from gateway.webrtc import INPUT_RATE_HZ, WebRtcOptions, WebRtcPeer
from gateway.websocket import WebSocketTransport, read_websocket, refuse_websocket, start_message
from voicemesh.audio import FRAME_MS
from voicemesh.auth import Principal, turn_credentials
from voicemesh.errors import RequestError, invalid
from voicemesh.limits import INPUT_RATES
from voicemesh.serving import server_tls
from voicemesh.tls import ServerTls

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
HTTP_STATUS = {
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,  # shutting down: offer again to reach another replica
}


class WebDoor:
    """The gateway's HTTP server: the page, its config, WebRTC offers and WebSocket sessions."""

    def __init__(self, registry: SessionRegistry, settings: GatewaySettings) -> None:
        self.registry = registry
        self.settings = settings
        self.origins = OriginPolicy(settings.allowed_origins)
        self.webrtc = WebRtcOptions.from_settings(settings)
        self.webrtc.install()
        self.port = 0
        self.scheme = "http"
        self._runner: web.AppRunner | None = None
        self._browsers: set[BrowserSession] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.realtime = RealtimeDoor(registry, settings, self.origins, self._run)
        self.telephony = TelephonyDoor(registry, settings, lambda *run: self._spawn(self._run(*run)))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_MESSAGE_BYTES)
        app.router.add_get("/", self._index)
        app.router.add_get("/api/config", self._config)
        app.router.add_post("/api/offer", self._offer)
        app.router.add_post("/api/ice-state", self._ice_state)
        app.router.add_get("/api/ws", self._websocket)
        app.router.add_get("/v1/realtime", self.realtime.handle)  # the OpenAI Realtime API (gateway/realtime/)
        app.router.add_static("/static/", STATIC_DIR)
        self.telephony.add_routes(app)  # /telephony/<carrier>/voice and /stream, for each carrier set up
        return app

    async def start(self, port: int) -> int:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        tls = server_tls(self.settings)
        # Browsers present no client certificates: the HTTP door uses the certificate without the client CA.
        context = ServerTls(tls.cert_file, tls.key_file).ssl_context() if tls else None
        self.scheme = "https" if tls else "http"
        site = web.TCPSite(runner, self.settings.host, port, ssl_context=context)
        try:
            await site.start()
        except OSError as error:
            await runner.cleanup()
            raise SystemExit(f"cannot bind HTTP {self.settings.host}:{port}: {error.strerror}") from error
        self._runner = runner
        self.port = runner.addresses[0][1]
        log.info("browser doors listening", extra={"url": f"{self.scheme}://{self._page_host()}:{self.port}/"})
        return self.port

    def _page_host(self) -> str:
        return "localhost" if self.settings.host in ("127.0.0.1", "0.0.0.0", "::", "::1", "") else self.settings.host

    async def stop(self) -> None:
        for browser in list(self._browsers):
            browser.shutdown()
        await self.realtime.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- handlers -----------------------------------------------------------------------------------------
    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def _config(self, request: web.Request) -> web.Response:
        """The page's settings; with auth on, only for a caller with a credential (they include TURN's)."""
        try:
            principal = self.registry.authenticate(request.headers.get("Authorization", ""), "config")
        except RequestError as error:
            return _error_response(error)
        return web.json_response(
            {
                "ice_servers": [*self.webrtc.page_ice_servers, *self._turn_servers(principal)],
                "webrtc_connect_timeout_s": self.settings.webrtc_connect_timeout_s,
                "idle_timeout_s": self.settings.idle_timeout_s,
                "frame_ms": FRAME_MS,
                "input_sample_rates_hz": list(INPUT_RATES.allowed),
            }
        )

    def _turn_servers(self, principal: Principal) -> list[dict[str, str | list[str]]]:
        """Short-lived TURN credentials for this caller (the TURN REST API scheme), if a TURN server is set."""
        urls = [url.strip() for url in self.settings.turn_urls.split(",") if url.strip()]
        if not (self.settings.turn_secret and urls):
            return []
        username, credential = turn_credentials(self.settings.turn_secret, principal.subject, self.settings.turn_ttl_s)
        return [{"urls": urls, "username": username, "credential": credential}]

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
            principal = self.registry.authenticate(request.headers.get("Authorization", ""), "offer")
            self.registry.admit(principal, request.remote or "")
            try:
                body = await request.json()
            except ValueError as error:
                raise invalid(f"the offer is not JSON ({error}); send {{sdp, type: 'offer', config}}") from error
            if not isinstance(body, dict) or body.get("type") != "offer" or not isinstance(body.get("sdp"), str):
                raise invalid("send {sdp, type: 'offer', config}: an SDP offer of type 'offer'")
            config = session_config(body.get("config"))
            config.input_sample_rate_hz = INPUT_RATE_HZ  # the mic track is decoded from Opus at 48 kHz
            session = await self.registry.open_session(config, door="webrtc", principal=principal)
        except RequestError as error:
            log.info("offer refused", extra={"code": error.code.name, "reason": error.message})
            return _error_response(error)
        browser = BrowserSession(self.registry, session, self.settings.idle_timeout_s, "webrtc")
        peer = WebRtcPeer(self.webrtc, browser)
        try:
            answer = await peer.answer(body["sdp"])
        except BaseException as error:  # whatever failed, the session opened for this offer is released
            try:
                await peer.close(CLOSE_BAD_REQUEST, "the offer was not understood")
            finally:
                await self.registry.end_session(session)
            if not isinstance(error, ValueError):
                raise
            return _error_response(invalid(f"the SDP offer was not understood: {error}"))
        self._spawn(self._run(browser, peer, peer.input_ended()))
        return web.json_response(
            {
                "sdp": answer.sdp,
                "type": answer.type,
                "session_id": browser.session_id,
                "resume_token": session.resume_token,
            }
        )

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        # No per-message deflate: PCM barely compresses and zlib on every 20 ms frame costs CPU and latency.
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=20.0, compress=False)
        await ws.prepare(request)
        try:
            self.origins.check(request.headers.get("Origin"), request.host)
            start = await start_message(ws)
            # A browser cannot set headers on a WebSocket: its credential comes in the start message, not the URL
            # (which ends up in access logs). Other clients may send the header.
            token = start.get("token")
            authorization = f"Bearer {token}" if isinstance(token, str) and token else ""
            principal = self.registry.authenticate(
                authorization or request.headers.get("Authorization", ""), "websocket"
            )
            self.registry.admit(principal, request.remote or "")
            config = session_config(start.get("config"))
            session = await self.registry.open_session(config, door="websocket", principal=principal)
        except RequestError as error:
            log.info("websocket refused", extra={"code": error.code.name, "reason": error.message})
            await refuse_websocket(ws, error)
            return ws
        browser = BrowserSession(self.registry, session, self.settings.idle_timeout_s, "websocket")
        fallback = start.get("fallback")
        if fallback:
            log.info("moved from WebRTC to WebSocket", extra={"session_id": browser.session_id, "fallback": fallback})
        transport = WebSocketTransport(ws, session.playout, browser.downlink)
        await self._spawn(self._run(browser, transport, read_websocket(ws, browser)))
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


def _error_response(error: RequestError) -> web.Response:
    body = {"error": {"code": error.code.name, "message": error.message}}
    if isinstance(error, RateLimited):  # this client is over its limit, not the gateway over its own
        return web.json_response(body, status=429, headers={"Retry-After": str(max(1, round(error.retry_after_s)))})
    return web.json_response(body, status=HTTP_STATUS.get(error.code, 400))
