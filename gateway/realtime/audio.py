"""The Realtime audio formats to and from the session's PCM16 (at the format's rate both ways): base64, and G.711
through voicemesh.g711."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterator

from gateway.realtime.config import AudioFormat, RealtimeProblem
from voicemesh import g711
from voicemesh.audio import Framer

MAX_APPEND_BYTES = 15 * 1024 * 1024  # the API's documented limit on one input_audio_buffer.append
_DECODE: dict[str, Callable[[bytes], bytes]] = {"audio/pcmu": g711.ulaw_decode, "audio/pcma": g711.alaw_decode}
_ENCODE: dict[str, Callable[[bytes], bytes]] = {"audio/pcmu": g711.ulaw_encode, "audio/pcma": g711.alaw_encode}


class AudioIn:
    """input_audio_buffer.append payloads -> 20 ms PCM16 frames at the session's input rate."""

    def __init__(self, audio_format: AudioFormat) -> None:
        self.format = audio_format
        self._framer = Framer(audio_format.rate_hz)
        self.received_ms = 0.0  # the input audio so far

    def frames(self, payload: object) -> Iterator[bytes]:
        """The whole frames `payload` (base64) completes; the rest waits for the next append."""
        if not isinstance(payload, str):
            raise RealtimeProblem("audio must be a base64 string", "missing_required_parameter", "audio")
        if len(payload) > MAX_APPEND_BYTES:
            raise RealtimeProblem(
                f"audio has {len(payload)} bytes; one append carries at most {MAX_APPEND_BYTES} (15 MiB)",
                "invalid_value",
                "audio",
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise RealtimeProblem(f"audio is not base64: {error}", "invalid_value", "audio") from error
        decode = _DECODE.get(self.format.type)
        if decode is not None:
            data = decode(data)
        elif len(data) % 2:
            raise RealtimeProblem(
                f"audio has {len(data)} bytes, odd; audio/pcm is 16-bit little-endian samples", "invalid_value", "audio"
            )
        self.received_ms += len(data) / 2 * 1000 / self.format.rate_hz
        return self._framer.push(data)

    def silence(self, ms: int) -> Iterator[bytes]:
        """`ms` of silence as frames (after what is pending): what makes the ASR close a turn the client commits."""
        return self._framer.push(bytes(self.format.rate_hz * ms // 1000 * 2))


class AudioOut:
    """The session's reply PCM16 -> base64 in the client's output format; one per response (its audio so far)."""

    def __init__(self, audio_format: AudioFormat) -> None:
        self.format = audio_format
        self.sent_ms = 0.0

    def encode(self, pcm16: bytes) -> str:
        self.sent_ms += len(pcm16) / 2 * 1000 / self.format.rate_hz
        encode = _ENCODE.get(self.format.type)
        return base64.b64encode(encode(pcm16) if encode is not None else pcm16).decode()
