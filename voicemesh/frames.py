"""Checks every receiver applies to incoming AudioFrames: encoding, rate, size and gap-free `seq`."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from voicemesh.errors import RequestError, invalid
from voicemesh.v1 import audio_pb2

MAX_FRAME_MS = 1000


def encoding_name(encoding: int) -> str:
    """The AudioEncoding's name, or its number for one the proto does not define (a client may send any)."""
    return audio_pb2.AudioEncoding.Name(encoding) if encoding in audio_pb2.AudioEncoding.values() else str(encoding)


class FrameChecker:
    """Validates the PCM16 frames of one stream; raises RequestError naming the field and what is allowed.

    With `max_ahead_ms`, audio may arrive faster than real time only by that much (a client catching up after a
    network hiccup): a flood is refused with RESOURCE_EXHAUSTED instead of queueing minutes of audio."""

    def __init__(
        self, sample_rate_hz: int, max_ahead_ms: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.sample_rate_hz = sample_rate_hz
        self.max_ahead_ms = max_ahead_ms
        self.last_seq: int | None = None
        self.frames = 0
        self._clock = clock
        self._started_s: float | None = None
        self._audio_ms = 0.0

    def check(self, frame: audio_pb2.AudioFrame) -> None:
        if frame.encoding != audio_pb2.AUDIO_ENCODING_PCM16LE:
            raise invalid(
                f"frame seq={frame.seq}: encoding={encoding_name(frame.encoding)} unsupported; send AUDIO_ENCODING_PCM16LE"
            )
        if frame.sample_rate_hz not in (0, self.sample_rate_hz):
            raise invalid(
                f"frame seq={frame.seq}: sample_rate_hz={frame.sample_rate_hz} differs from the configured "
                f"{self.sample_rate_hz}; send {self.sample_rate_hz} (or 0)"
            )
        size = len(frame.data)
        if size == 0:
            raise invalid(f"frame seq={frame.seq}: data is empty; send 20 ms of PCM16LE audio")
        if size % 2:
            raise invalid(f"frame seq={frame.seq}: data has {size} bytes, odd; PCM16LE needs 2 bytes per sample")
        max_bytes = self.sample_rate_hz * 2 * MAX_FRAME_MS // 1000
        if size > max_bytes:
            raise RequestError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"frame seq={frame.seq}: {size} bytes is over {MAX_FRAME_MS} ms of audio ({max_bytes} bytes); "
                "send 20 ms frames",
            )
        if self.last_seq is not None:
            expected = self.last_seq + 1
            if frame.seq < expected:
                raise invalid(f"frame seq={frame.seq} after seq={self.last_seq}: seq must increase by 1")
            if frame.seq > expected:
                raise RequestError(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"frame seq={frame.seq} after seq={self.last_seq}: {frame.seq - expected} frame(s) missing; "
                    "seq must increase by 1 without gaps",
                )
        self.last_seq = frame.seq
        self.frames += 1
        if self.max_ahead_ms is not None:
            self._pace(size / 2 * 1000 / self.sample_rate_hz)

    def _pace(self, frame_ms: float) -> None:
        now_s = self._clock()
        if self._started_s is None:
            self._started_s = now_s
        self._audio_ms += frame_ms
        ahead_ms = self._audio_ms - (now_s - self._started_s) * 1000
        if self.max_ahead_ms is not None and ahead_ms > self.max_ahead_ms:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"audio arrives faster than real time ({ahead_ms / 1000:.1f} s ahead of the clock, at most "
                f"{self.max_ahead_ms / 1000:g} s allowed); send each frame as it is captured",
            )
