"""A conversation over the gateway's Twilio phone door with the interface of `ConversationClient`, so a load test
can drive calls: 16 kHz frames in (sent as 8 kHz μ-law by a test carrier, voicemesh/phone.py), and the events a
carrier can know of out: the reply's audio, and a reply's end once its audio stopped and every mark came back.

A phone door tells the caller nothing else (no transcripts, no gateway metrics): the TurnMetrics this client yields
carries only what a carrier knows, the arrival of the reply's first audio after the caller's last sound (audio of a
reply the caller was talking over does not count), and, as speech_end_capture_us, when that last sound was sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from voicemesh.audio import StreamResampler, float_to_pcm16, pcm16_to_float
from voicemesh.clients import epoch_us
from voicemesh.conversation import ConversationFailed, Event, ReplyAudio, ReplyDone, Started, TurnMetrics
from voicemesh.phone import PHONE_RATE_HZ, CallRefused, Carrier, PhoneCall
from voicemesh.v1 import conversation_pb2

REPLY_QUIET_S = 0.6  # no reply audio for this long, every mark back: the reply is over
REPLY_PAUSE_US = 100_000  # media after a pause this long (or a clear) begins a reply
VOICE_LEVEL = 64  # a frame with a sample above this (-54 dBFS) is the caller's sound, not the silence between turns
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
    _last_voice_us: int = 0

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
        if np.abs(np.frombuffer(pcm16, dtype="<i2")).max(initial=0) > VOICE_LEVEL:
            self._last_voice_us = epoch_us()
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
        after_voice_us = 0  # the first media since the caller's last sound
        previous_media_us = 0
        cleared = False
        try:
            while not (call.closed.is_set() and seen == len(call.received)):
                if after_voice_us and self._last_voice_us > after_voice_us:
                    after_voice_us = reply_started_us = 0  # the caller spoke again: what played so far answered nothing
                for heard in call.received[seen:]:
                    seen += 1
                    if heard.kind == "clear":
                        cleared = True
                    if heard.kind != "media":
                        continue
                    # A reply begins after the caller's last sound, after a pause in the audio or a clear: media of a
                    # reply the caller talked over is not the answer to what they said.
                    after_voice = heard.at_us > self._last_voice_us
                    if after_voice and not after_voice_us:
                        after_voice_us = heard.at_us
                    pause = not previous_media_us or heard.at_us - previous_media_us > REPLY_PAUSE_US
                    if after_voice and (pause or cleared) and not reply_started_us:
                        reply_started_us = heard.at_us
                    previous_media_us, cleared = heard.at_us, False
                    yield ReplyAudio(self._turn, heard.pcm16, PHONE_RATE_HZ, "", 0, heard.at_us, 0)
                quiet = epoch_us() - previous_media_us > REPLY_QUIET_S * 1e6 and call.marks_pending == 0
                if after_voice_us and quiet:
                    first_audio_us = reply_started_us or after_voice_us
                    yield ReplyDone(self._turn, "")
                    server = conversation_pb2.TurnMetrics(speech_end_capture_us=self._last_voice_us)
                    yield TurnMetrics(self._turn, server, first_audio_us)
                    self._turn += 1
                    reply_started_us = after_voice_us = 0
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
