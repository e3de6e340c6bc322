"""Checks every receiver applies to incoming AudioFrames: encoding, rate, size and gap-free `seq`."""

from __future__ import annotations

import grpc

from voicemesh.errors import RequestError, invalid
from voicemesh.v1 import audio_pb2

MAX_FRAME_MS = 1000


class FrameChecker:
    """Validates the PCM16 frames of one stream; raises RequestError naming the field and what is allowed."""

    def __init__(self, sample_rate_hz: int) -> None:
        self.sample_rate_hz = sample_rate_hz
        self.last_seq: int | None = None
        self.frames = 0

    def check(self, frame: audio_pb2.AudioFrame) -> None:
        if frame.encoding != audio_pb2.AUDIO_ENCODING_PCM16LE:
            name = audio_pb2.AudioEncoding.Name(frame.encoding) if frame.encoding in (0, 1, 2) else frame.encoding
            raise invalid(f"frame seq={frame.seq}: encoding={name} unsupported; send AUDIO_ENCODING_PCM16LE")
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
