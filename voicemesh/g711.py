"""G.711 μ-law and A-law (ITU-T G.711) to and from 16-bit little-endian PCM, as phone carriers stream them.

Decoding is a 256-entry table, encoding a 65,536-entry table indexed by the sample itself, both built once with
numpy from the standard's segment rules, so a 20 ms frame costs one lookup and no Python loop per sample.
"""

from __future__ import annotations

import numpy as np

from voicemesh.audio import Clip, float_to_pcm16, pcm16_to_float
from voicemesh.errors import invalid

_ULAW_BIAS = 0x84
_ULAW_CLIP = 8159  # largest magnitude on μ-law's 14-bit scale
_ULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _ulaw_decode_table() -> np.ndarray:
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    magnitude = (((code & 0x0F) << 3) + _ULAW_BIAS) << ((code & 0x70) >> 4)
    return np.where(code & 0x80, _ULAW_BIAS - magnitude, magnitude - _ULAW_BIAS).astype("<i2")


def _alaw_decode_table() -> np.ndarray:
    code = np.arange(256, dtype=np.int32) ^ 0x55
    mantissa = (code & 0x0F) << 4
    segment = (code & 0x70) >> 4
    magnitude = np.where(segment == 0, mantissa + 8, (mantissa + 0x108) << np.maximum(segment - 1, 0))
    return np.where(code & 0x80, magnitude, -magnitude).astype("<i2")


def _ulaw_encode_table() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int32) >> 2  # 14-bit scale; arithmetic shift, as the standard's C
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.abs(pcm), _ULAW_CLIP) + (_ULAW_BIAS >> 2)
    segment = np.searchsorted(_ULAW_SEGMENT_ENDS, magnitude)
    code = np.where(segment >= 8, 0x7F, (segment << 4) | ((magnitude >> (segment + 1)) & 0x0F))
    return _by_unsigned_index((code ^ mask).astype(np.uint8))


def _alaw_encode_table() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int32) >> 3  # 13-bit scale
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    magnitude = np.where(pcm >= 0, pcm, -pcm - 1)
    segment = np.searchsorted(_ALAW_SEGMENT_ENDS, magnitude)
    mantissa = np.where(segment < 2, magnitude >> 1, magnitude >> np.maximum(segment, 1)) & 0x0F
    code = np.where(segment >= 8, 0x7F, (segment << 4) | mantissa)
    return _by_unsigned_index((code ^ mask).astype(np.uint8))


def _by_unsigned_index(codes_from_most_negative: np.ndarray) -> np.ndarray:
    """Reorder a table built for samples -32768..32767 so the sample's bits read as uint16 index it."""
    return np.roll(codes_from_most_negative, -32768)


_ULAW_DECODE = _ulaw_decode_table()
_ALAW_DECODE = _alaw_decode_table()
_ULAW_ENCODE = _ulaw_encode_table()
_ALAW_ENCODE = _alaw_encode_table()


def _lookup(table: np.ndarray, indices: np.ndarray) -> bytes:
    coded: np.ndarray = table[indices]
    return coded.tobytes()


def _pcm16_indices(pcm16: bytes) -> np.ndarray:
    if len(pcm16) % 2:
        raise invalid(f"PCM16 audio has {len(pcm16)} bytes; send a whole number of 2-byte samples")
    return np.frombuffer(pcm16, dtype="<u2")


def ulaw_decode(data: bytes) -> bytes:
    """μ-law bytes, one sample each, to 16-bit little-endian PCM."""
    return _lookup(_ULAW_DECODE, np.frombuffer(data, dtype=np.uint8))


def ulaw_encode(pcm16: bytes) -> bytes:
    """16-bit little-endian PCM to μ-law, one byte a sample."""
    return _lookup(_ULAW_ENCODE, _pcm16_indices(pcm16))


def alaw_decode(data: bytes) -> bytes:
    """A-law bytes, one sample each, to 16-bit little-endian PCM."""
    return _lookup(_ALAW_DECODE, np.frombuffer(data, dtype=np.uint8))


def alaw_encode(pcm16: bytes) -> bytes:
    """16-bit little-endian PCM to A-law, one byte a sample."""
    return _lookup(_ALAW_ENCODE, _pcm16_indices(pcm16))


def telephone_band(clip: Clip, codec: str = "PCMU") -> Clip:
    """The clip as a phone carries it: 8 kHz, through G.711 (`PCMU` μ-law or `PCMA` A-law) and back."""
    narrow = clip.to_rate(8000)
    encode, decode = (ulaw_encode, ulaw_decode) if codec == "PCMU" else (alaw_encode, alaw_decode)
    return Clip(pcm16_to_float(decode(encode(float_to_pcm16(narrow.samples)))), 8000)
