"""Audio helpers shared by every service: PCM16 <-> float, streaming resampling, 20 ms framing, WAV files."""

from __future__ import annotations

import fractions
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import soxr

if TYPE_CHECKING:
    import av

FRAME_MS = 20
ASR_RATE_HZ = 16000


def pcm16_to_float(data: bytes) -> np.ndarray:
    """PCM16LE bytes -> float32 samples in [-1, 1)."""
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """float samples -> PCM16LE bytes (clipped)."""
    return bytes((np.clip(samples, -1.0, 32767 / 32768) * 32768.0).astype("<i2").tobytes())


def samples_per_frame(rate_hz: int, frame_ms: int = FRAME_MS) -> int:
    return rate_hz * frame_ms // 1000


class StreamResampler:
    """Resamples a stream chunk by chunk with libswresample (PyAV), keeping its filter state between chunks; the
    identity when the rates match.

    It holds back ~1 ms of a stream, so the ASR hears the end of a 48 kHz caller's speech (every browser page) at
    once; soxr's stream held back tens of ms (docs/decisions/0028). libswresample's default filter passes 7 kHz at
    -0.4 dB and leaves 9 kHz at -62 dB on the way to 16 kHz.
    """

    def __init__(self, in_rate_hz: int, out_rate_hz: int) -> None:
        self.in_rate_hz = in_rate_hz
        self.out_rate_hz = out_rate_hz
        self._resampler: av.AudioResampler | None = None
        self._pts = 0
        if in_rate_hz != out_rate_hz:
            import av  # the ASR's and the gateway's dependency, not the core's

            self._resampler = av.AudioResampler(format="flt", layout="mono", rate=out_rate_hz)

    def process(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        """The resampled audio of `samples` (float32 mono) that is ready; `last`: also what the filter still holds."""
        if self._resampler is None:
            return samples.astype(np.float32, copy=False)
        import av

        frames = []
        if len(samples):
            frame = av.AudioFrame.from_ndarray(
                samples.astype(np.float32, copy=False).reshape(1, -1), format="flt", layout="mono"
            )
            frame.sample_rate = self.in_rate_hz
            frame.time_base = fractions.Fraction(1, self.in_rate_hz)
            frame.pts = self._pts
            self._pts += len(samples)
            frames = self._resampler.resample(frame)
        if last:
            frames += self._resampler.resample(None)
        if not frames:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames])


def resample(samples: np.ndarray, in_rate_hz: int, out_rate_hz: int) -> np.ndarray:
    """Resample a whole signal."""
    if in_rate_hz == out_rate_hz:
        return samples.astype(np.float32, copy=False)
    resampled: np.ndarray = soxr.resample(samples.astype(np.float32, copy=False), in_rate_hz, out_rate_hz, quality="HQ")
    return resampled


class Framer:
    """Cuts a stream of PCM16 bytes into fixed frames; `flush` pads the tail with silence."""

    def __init__(self, rate_hz: int, frame_ms: int = FRAME_MS) -> None:
        self.frame_bytes = samples_per_frame(rate_hz, frame_ms) * 2
        self._pending = bytearray()

    def push(self, data: bytes) -> Iterator[bytes]:
        self._pending += data
        while len(self._pending) >= self.frame_bytes:
            yield bytes(self._pending[: self.frame_bytes])
            del self._pending[: self.frame_bytes]

    def flush(self) -> Iterator[bytes]:
        if self._pending:
            yield bytes(self._pending) + b"\x00" * (self.frame_bytes - len(self._pending))
            self._pending.clear()


@dataclass(frozen=True)
class Clip:
    """Mono float32 audio and its rate."""

    samples: np.ndarray
    rate_hz: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.rate_hz

    def to_rate(self, rate_hz: int) -> Clip:
        return Clip(resample(self.samples, self.rate_hz, rate_hz), rate_hz)

    def pcm16(self) -> bytes:
        return float_to_pcm16(self.samples)

    def frames(self, frame_ms: int = FRAME_MS) -> list[bytes]:
        framer = Framer(self.rate_hz, frame_ms)
        return [*framer.push(self.pcm16()), *framer.flush()]


def block_levels_db(audio: np.ndarray, rate_hz: int) -> np.ndarray:
    """The level of each whole 10 ms block, dBFS (digital silence at -120)."""
    block = rate_hz // 100
    blocks = audio[: len(audio) // block * block].reshape(-1, block)
    levels: np.ndarray = 10 * np.log10(np.mean(blocks.astype(np.float64) ** 2, axis=1) + 1e-12)
    return levels


def noise_floor_db(levels: np.ndarray) -> float:
    """A recording's noise floor from its `block_levels_db`: the 5th percentile of the blocks that are not digital
    silence; -120.0 when all are."""
    sounding = levels[levels > -100]
    return float(np.percentile(sounding, 5)) if len(sounding) else -120.0


def speech_end_ms(audio: np.ndarray, rate_hz: int, within_db: float = 35.0) -> float:
    """End of the last 10 ms block within `within_db` of the loudest block and 10 dB above the noise floor
    (`noise_floor_db`); 0.0 when there is none. Without the floor a recording's room noise counts as speech
    (wizard.wav's last 230 ms sit at its floor, -40 to -49 dBFS)."""
    level = block_levels_db(audio, rate_hz)
    if not len(level):
        return 0.0
    loud = np.flatnonzero(level > max(level.max() - within_db, noise_floor_db(level) + 10))
    return float((loud[-1] + 1) * 10) if len(loud) else 0.0


def read_wav(path: str | Path) -> Clip:
    """Read a PCM16 WAV (any rate, mono or stereo -> mono)."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV is supported (sample width {wav.getsampwidth()} bytes)")
        channels = wav.getnchannels()
        rate = wav.getframerate()
        data = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    if channels > 1:
        data = data.reshape(-1, channels).mean(axis=1)
    return Clip(data, rate)


def write_wav(path: str | Path, pcm16: bytes, rate_hz: int) -> None:
    """Write mono PCM16LE bytes as a WAV file."""
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes(pcm16)
