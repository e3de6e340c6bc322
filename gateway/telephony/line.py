"""One phone call's stream as a transport of a BrowserSession (gateway/browser.py): the reply's frames out as the
carrier's media messages at real-time pace, a mark after each chunk, `clear` on a barge-in; and the caller's messages
in: audio to the session, DTMF to the session, marks echoed back as what the caller heard."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import WSMessage, WSMsgType, web

from gateway.browser import BrowserSession
from gateway.downlink import DownlinkWatch
from gateway.playout import FRAME_S, LEAD_FRAMES
from gateway.protocol import close_reason
from gateway.session import ReplyFrame, Session
from gateway.telephony.carrier import CODECS, CarrierError, Digit, MarkEcho, Media, MediaStream, Start, Stop
from gateway.telephony.marks import MARK_TIMEOUT_S, MarkLedger
from gateway.telephony.uplink import CallerAudio
from voicemesh.clients import epoch_us
from voicemesh.errors import invalid

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
MARK_CHECK_S = 0.5


class PhoneLine:
    """The gateway's side of one call's media stream.

    The session counts a chunk of its reply as spoken only when the carrier echoes the mark sent after it
    (`Session.heard_on_confirmation`), so the history keeps what the caller heard. On a barge-in the door sends
    `clear` at once, and no frame of a cleared turn is sent after it.
    """

    def __init__(
        self,
        ws: web.WebSocketResponse,
        carrier: MediaStream,
        start: Start,
        session: Session,
        downlink: DownlinkWatch,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ws = ws
        self.carrier = carrier
        self.stream_id = start.stream_id
        self.session = session
        self.downlink = downlink
        self.audio = CallerAudio(start.encoding)
        self.marks = MarkLedger()
        self.cleared_turn = -1  # the latest turn whose audio was cleared: none of its frames leave after that
        self.media_sent = 0
        self._encode = CODECS[start.encoding][1]
        self._clock = clock
        session.heard_on_confirmation = True
        self._player = session.playout.start(self._send_audio)
        self._mark_check = asyncio.ensure_future(self._expire_marks())

    # ---- out ---------------------------------------------------------------------------------------------------
    async def _send_audio(self, frame: ReplyFrame, sent_us: int) -> None:
        if frame.turn_index <= self.cleared_turn:
            return
        await self._send(self.carrier.media(self.stream_id, self._encode(frame.speech.frame.data)))
        self.media_sent += 1
        if frame.speech.chunk_end:
            # The carrier holds at most the playout's lead ahead of what it plays.
            due_s = self._clock() + LEAD_FRAMES * FRAME_S + MARK_TIMEOUT_S
            name = self.marks.add(frame.turn_index, frame.speech.text, due_s)
            await self._send(self.carrier.mark(self.stream_id, name))

    async def send_json(self, message: dict[str, Any]) -> None:
        """The session's events, as BrowserSession forwards them: a phone has no screen, so only a barge-in (clear the
        carrier's queued audio) and the session's errors (logged) mean anything here."""
        kind = message.get("type")
        if kind == "interrupted":
            await self.clear(int(message.get("turn_index", 0)))
        elif kind == "error":
            log.info(
                "session error",
                extra={
                    "session_id": self.session.options.session_id,
                    "code": message.get("code"),
                    "reason": message.get("message"),
                    "recoverable": message.get("recoverable"),
                },
            )

    async def clear(self, turn_index: int) -> None:
        """Drop the audio the carrier has queued for `turn_index` (and any before it)."""
        self.cleared_turn = max(self.cleared_turn, turn_index)
        self.marks.clear_turn(turn_index)
        await self._send(self.carrier.clear(self.stream_id))

    async def _send(self, message: dict[str, Any]) -> None:
        if self.ws.closed:
            return
        # ConnectionError: the carrier went away; the reader sees it and ends the session.
        with contextlib.suppress(ConnectionError), self.downlink.sending():
            await self.ws.send_str(json.dumps(message))

    async def close(self, code: int, reason: str) -> None:
        self._player.cancel()
        self._mark_check.cancel()
        await asyncio.gather(self._player, self._mark_check, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ws.close(code=code, message=close_reason(reason)), CLOSE_TIMEOUT_S)

    # ---- in ----------------------------------------------------------------------------------------------------
    def on_mark(self, name: str) -> None:
        mark = self.marks.echoed(name)
        if mark is not None:
            self.session.confirm_heard(mark.turn_index, mark.text)

    async def _expire_marks(self) -> None:
        """A carrier that never echoes a mark must not hold the reply open: past its due time it counts as unheard."""
        while True:
            await asyncio.sleep(MARK_CHECK_S)
            for mark in self.marks.overdue(self._clock()):
                log.warning(
                    "mark not echoed in time; its words count as unheard",
                    extra={"session_id": self.session.options.session_id, "mark": mark.name},
                )
                self.session.confirm_heard(mark.turn_index, mark.text, heard=False)


def decode_message(message: WSMessage, carrier: MediaStream) -> dict[str, Any]:
    """A carrier's WebSocket message as the JSON object it must be; INVALID_ARGUMENT otherwise."""
    if message.type != WSMsgType.TEXT:
        raise invalid(f"a {message.type.name} message; {carrier.name} sends JSON text messages")
    try:
        decoded = json.loads(message.data)
    except ValueError as error:
        raise invalid(f"a message is not JSON: {error}") from None
    if not isinstance(decoded, dict):
        raise invalid("a message is not a JSON object")
    return decoded


async def read_call(ws: web.WebSocketResponse, line: PhoneLine, browser: BrowserSession) -> None:
    """The carrier's side after the start, until `stop` or the socket closes; raises RequestError for bad input."""
    async for message in ws:
        decoded = decode_message(message, line.carrier)
        event = line.carrier.parse(decoded)
        if isinstance(event, Media):
            if event.inbound:
                for pcm16 in line.audio.push(event.chunk, event.payload):
                    browser.push_audio(pcm16, epoch_us())
        elif isinstance(event, MarkEcho):
            line.on_mark(event.name)
        elif isinstance(event, Digit):
            browser.session.on_dtmf(event.digit, event.duration_ms)
        elif isinstance(event, Stop):
            return
        elif isinstance(event, CarrierError):
            log.warning("carrier reports an error", extra={"session_id": browser.session_id, "detail": event.detail})
        else:
            raise invalid(f"a second {type(event).__name__.lower()} message after the stream started")
