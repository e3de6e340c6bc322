"""The WebSocket transport of /api/ws (messages in gateway/protocol.py): the start message, frames and control in;
events as text and the reply's audio as binary frames out, played from the session's playout at real time."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import WSMsgType, web

from gateway.browser import BrowserSession
from gateway.downlink import DownlinkWatch
from gateway.playout import Playout
from gateway.protocol import (
    FRAME_HEADER,
    close_code,
    close_reason,
    error_message,
    parse_uplink_frame,
)
from gateway.session import ReplyFrame
from voicemesh.errors import RequestError, invalid

START_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0  # for the close handshake; a page that is not reading never answers, and its socket is cut


class WebSocketTransport:
    """One page's WebSocket: events are sent as they come, reply frames as the playout lets them go.

    A send waits while the socket's buffers are full (aiohttp drains past 64 KB), so a page that stops reading holds
    them there, and `downlink` notices: nothing piles up in the gateway but those buffers.
    """

    def __init__(self, ws: web.WebSocketResponse, playout: Playout[ReplyFrame], downlink: DownlinkWatch) -> None:
        self.ws = ws
        self.downlink = downlink
        self._player = playout.start(self._send_audio)

    async def _send_audio(self, frame: ReplyFrame, sent_us: int) -> None:
        # Stamped as the frame leaves, so the page's downlink measure includes the pacing.
        await self._send(FRAME_HEADER.pack(sent_us, frame.turn_index) + frame.speech.frame.data)

    async def send_json(self, message: dict[str, Any]) -> None:
        await self._send(json.dumps(message))

    async def _send(self, data: str | bytes) -> None:
        if self.ws.closed:
            return
        # ConnectionError: the page went away; the reader sees it and ends the session.
        with contextlib.suppress(ConnectionError), self.downlink.sending():
            if isinstance(data, bytes):
                await self.ws.send_bytes(data)
            else:
                await self.ws.send_str(data)

    async def close(self, code: int, reason: str) -> None:
        self._player.cancel()
        await asyncio.gather(self._player, return_exceptions=True)
        # On a timeout aiohttp cuts the connection (close code 1006 on the page's side, if it ever reads again).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ws.close(code=code, message=close_reason(reason)), CLOSE_TIMEOUT_S)


async def start_message(ws: web.WebSocketResponse) -> dict[str, Any]:
    """The page's first message, {"type": "start", "config": {...}}; raises RequestError for anything else."""
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


async def read_websocket(ws: web.WebSocketResponse, browser: BrowserSession) -> None:
    """The page's side after the start: audio frames and control messages, until it closes."""
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


async def refuse_websocket(ws: web.WebSocketResponse, error: RequestError) -> None:
    """Refuse before any session exists: the error event, then the close with its code (1001 from a gateway that is
    shutting down: the page may start again, on another replica)."""
    code = close_code(error)
    with contextlib.suppress(ConnectionError):  # the page has gone already (it closed instead of starting)
        await ws.send_str(json.dumps(error_message(error)))
        await ws.close(code=code, message=close_reason(error.message))
