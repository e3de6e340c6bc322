"""/v1/realtime: the OpenAI Realtime API's WebSocket, checked like the other doors (a bearer credential, or the
`openai-insecure-api-key.<key>` subprotocol browsers send), then one RealtimeConnection per socket.

The voicemesh session opens at the first client event that needs it (audio, an item, a response), so the settings
of a session.update sent first (voice, formats, turn detection) are the session's own from its start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import WSMsgType, web

from gateway.browser import BrowserSession, Transport
from gateway.origins import OriginPolicy
from gateway.protocol import close_code, close_reason
from gateway.realtime.audio import MAX_APPEND_BYTES
from gateway.realtime.client_events import RealtimeConnection
from gateway.realtime.config import RealtimeConfig, RealtimeProblem
from gateway.realtime.events import RealtimeConversation, new_id
from gateway.realtime.transport import RealtimeTransport
from gateway.registry import SessionRegistry
from gateway.settings import GatewaySettings
from voicemesh.errors import RequestError

log = logging.getLogger(__name__)

SUBPROTOCOL = "realtime"
KEY_PROTOCOL = "openai-insecure-api-key."
DEFAULT_MODEL = "voicemesh"
# Room for the documented 15 MiB of audio in one append, base64 and JSON around it: a larger message is refused by
# the socket itself (close 1009), a smaller over-limit append with an error event.
MAX_EVENT_BYTES = MAX_APPEND_BYTES * 4 // 3 + 64 * 1024

Runner = Callable[[BrowserSession, Transport, Awaitable[None]], Awaitable[None]]


class RealtimeDoor:
    """The aiohttp handler of /v1/realtime; `run` runs an opened session (the web door's browser sessions)."""

    def __init__(
        self, registry: SessionRegistry, settings: GatewaySettings, origins: OriginPolicy, run: Runner
    ) -> None:
        self.registry = registry
        self.settings = settings
        self.origins = origins
        self.run = run
        self._sockets: set[web.WebSocketResponse] = set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(
            protocols=(SUBPROTOCOL,), max_msg_size=MAX_EVENT_BYTES, heartbeat=20.0, compress=False
        )
        await ws.prepare(request)
        conversation = RealtimeConversation(RealtimeConfig())
        transport = RealtimeTransport(ws, conversation)
        try:
            self.origins.check(request.headers.get("Origin"), request.host)
            principal = self.registry.authenticate(_authorization(request), "realtime")
            self.registry.admit(principal, request.remote or "")
        except RequestError as error:
            log.info("realtime refused", extra={"code": error.code.name, "reason": error.message})
            await refuse(transport, error)
            return ws
        model = request.query.get("model", DEFAULT_MODEL)[:128]
        connection = RealtimeConnection(
            self.registry, self.settings, principal, transport, new_id("sess"), model, self.run
        )
        self._sockets.add(ws)
        try:
            await transport.send([conversation.event("session.created", session=connection.describe())])
            await connection.serve(read_events(ws, transport))
        finally:
            self._sockets.discard(ws)
        return ws

    async def stop(self) -> None:
        """Close the sockets that have no session yet (those with one close with their session)."""
        for ws in list(self._sockets):
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(ws.close(code=1001, message=b"the gateway is shutting down"), 2.0)


async def read_events(ws: web.WebSocketResponse, transport: RealtimeTransport) -> AsyncIterator[dict[str, Any]]:
    """The client's events as JSON objects; what is not one gets an error event and is skipped."""
    async for message in ws:
        if message.type != WSMsgType.TEXT:
            if message.type == WSMsgType.BINARY:
                problem = RealtimeProblem(
                    "send events as JSON text messages; audio goes base64 in events", "invalid_json"
                )
                await transport.send([transport.conversation.error(problem)])
            continue
        try:
            event = json.loads(message.data)
        except ValueError as error:
            problem = RealtimeProblem(f"the message is not JSON: {error}", "invalid_json")
            await transport.send([transport.conversation.error(problem)])
            continue
        if not isinstance(event, dict):
            problem = RealtimeProblem("an event must be a JSON object with a type", "invalid_json")
            await transport.send([transport.conversation.error(problem)])
            continue
        yield event


async def refuse(transport: RealtimeTransport, error: RequestError) -> None:
    """Refuse before any session exists: an error event, then the close with its code."""
    code = "invalid_api_key" if error.code.name == "UNAUTHENTICATED" else error.code.name.lower()
    problem = RealtimeProblem(error.message, code)
    with contextlib.suppress(ConnectionError):
        await transport.send([transport.conversation.error(problem)])
        await transport.ws.close(code=close_code(error), message=close_reason(error.message))


def _authorization(request: web.Request) -> str:
    """`Authorization`, or a browser's key from its subprotocols, as a bearer value."""
    header = request.headers.get("Authorization", "")
    if header:
        return header
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    for protocol in (p.strip() for p in offered.split(",")):
        if protocol.startswith(KEY_PROTOCOL):
            return f"Bearer {protocol[len(KEY_PROTOCOL) :]}"
    return ""
