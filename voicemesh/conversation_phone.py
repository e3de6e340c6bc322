"""A conversation over the gateway's Twilio phone door with the interface of `ConversationClient`, so a load test
can drive calls: 16 kHz frames in (sent as 8 kHz μ-law by a test carrier, voicemesh/phone.py), and the events a
carrier can know of out: the reply's audio, and a reply's end once its audio stopped and every mark came back.

A phone door tells the caller nothing else (no transcripts, no gateway metrics): the TurnMetrics this client yields
carries only the first reply audio's arrival, and speech_end_capture_us set to it, so a V2V counted from "the last
speech frame sent no later than the server's end of speech" counts from the last speech frame before the reply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from voicemesh.audio import StreamResampler, float_to_pcm16, pcm16_to_float
from voicemesh.conversation import ConversationFailed, Event, ReplyAudio, ReplyDone, Started, TurnMetrics
from voicemesh.phone import PHONE_RATE_HZ, CallRefused, Carrier, PhoneCall
from voicemesh.v1 import conversation_pb2

REPLY_QUIET_S = 0.6  # no reply audio for this long, every mark back: the reply is over
POLL_S = 0.02


@dataclass
class PhoneConversationClient:
    """One call over /telephony/twilio. `send` 20 ms of PCM16 at the config's input rate, iterate `events()`,
    `close` hangs up once the last reply is over. A refused call raises ConversationFailed."""

    target: str
    """The gateway's HTTP door, HOST:PORT."""
    config: conversation_pb2.SessionConfig
    auth_token: str
    """The gateway's twilio_auth_token: the test carrier signs its webhooks with it."""
    _call: PhoneCall | None = None
    _outbox: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    _resampler: StreamResampler | None = None
    _turn: int = 0

    async def __aenter__(self) -> PhoneConversationClient:
        self._call = PhoneCall(self.target, Carrier("twilio", self.auth_token), call_id=self.config.session_id or "CA")
        self._resampler = StreamResampler(self.config.input_sample_rate_hz or 16000, PHONE_RATE_HZ)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._call is not None:
            await self._call.close()

    def send(self, pcm16: bytes) -> None:
        """Queue one frame of the caller's audio (sent as it would leave the phone: 8 kHz G.711)."""
        assert self._resampler is not None, "use `async with PhoneConversationClient(...)`"
        self._outbox.put_nowait(float_to_pcm16(self._resampler.process(pcm16_to_float(pcm16))))

    def close(self) -> None:
        """No more audio: hang up once the reply being played is over."""
        self._outbox.put_nowait(None)

    async def events(self) -> AsyncIterator[Event]:
        call = self._call
        assert call is not None, "use `async with PhoneConversationClient(...)`"
        try:
            await call.dial()
        except (CallRefused, OSError) as error:
            raise ConversationFailed("UNAVAILABLE", f"the phone door refused the call: {error}") from error
        yield Started(call.session_id, 0, "")
        writer = asyncio.ensure_future(self._write(call))
        seen = 0  # of call.received
        reply_started_us = 0
        last_media_s = 0.0
        try:
            while not (call.closed.is_set() and seen == len(call.received)):
                for heard in call.received[seen:]:
                    seen += 1
                    if heard.kind != "media":
                        continue
                    reply_started_us = reply_started_us or heard.at_us
                    last_media_s = time.monotonic()
                    yield ReplyAudio(self._turn, heard.pcm16, PHONE_RATE_HZ, "", 0, heard.at_us, 0)
                quiet = time.monotonic() - last_media_s > REPLY_QUIET_S and call.marks_pending == 0
                if reply_started_us and quiet:
                    yield ReplyDone(self._turn, "")
                    server = conversation_pb2.TurnMetrics(speech_end_capture_us=reply_started_us)
                    yield TurnMetrics(self._turn, server, reply_started_us)
                    self._turn += 1
                    reply_started_us = 0
                if writer.done():
                    writer.result()
                    return  # hung up
                await asyncio.sleep(POLL_S)
            if call.close_code not in (None, 1000):
                raise ConversationFailed(f"CLOSE_{call.close_code}", "the phone door closed the call")
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _write(self, call: PhoneCall) -> None:
        pending = np.zeros(0, dtype="<i2").tobytes()
        chunk_bytes = PHONE_RATE_HZ // 50 * 2
        while (item := await self._outbox.get()) is not None:
            pending += item
            while len(pending) >= chunk_bytes:
                await call.send(pending[:chunk_bytes])
                pending = pending[chunk_bytes:]
        while call.marks_pending:  # the last reply plays out, then the caller hangs up
            await asyncio.sleep(POLL_S)
        await call.hang_up()
