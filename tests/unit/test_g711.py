"""G.711: every sample and every code against a per-sample reference written from the standard's segment rules,
against the stdlib's audioop where it still imports, and the code points the standard fixes."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from voicemesh import g711
from voicemesh.errors import RequestError

EVERY_SAMPLE = np.arange(-32768, 32768, dtype="<i2").tobytes()
EVERY_CODE = bytes(range(256))


def reference_ulaw_encode(sample: int) -> int:
    value = sample >> 2
    mask = 0xFF
    if value < 0:
        value, mask = -value, 0x7F
    value = min(value, 8159) + 33
    for segment, end in enumerate((0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF)):
        if value <= end:
            return ((segment << 4) | ((value >> (segment + 1)) & 0x0F)) ^ mask
    return 0x7F ^ mask


def reference_ulaw_decode(code: int) -> int:
    code = ~code & 0xFF
    magnitude = (((code & 0x0F) << 3) + 0x84) << ((code & 0x70) >> 4)
    return 0x84 - magnitude if code & 0x80 else magnitude - 0x84


def reference_alaw_encode(sample: int) -> int:
    value = sample >> 3
    if value >= 0:
        mask = 0xD5
    else:
        mask, value = 0x55, -value - 1
    for segment, end in enumerate((0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF)):
        if value <= end:
            mantissa = (value >> 1 if segment < 2 else value >> segment) & 0x0F
            return ((segment << 4) | mantissa) ^ mask
    return 0x7F ^ mask


def reference_alaw_decode(code: int) -> int:
    code ^= 0x55
    magnitude = (code & 0x0F) << 4
    segment = (code & 0x70) >> 4
    magnitude = magnitude + 8 if segment == 0 else (magnitude + 0x108) << (segment - 1)
    return magnitude if code & 0x80 else -magnitude


def samples(pcm16: bytes) -> list[int]:
    return [int(s) for s in np.frombuffer(pcm16, dtype="<i2")]


def test_ulaw_matches_the_reference_for_every_sample_and_code() -> None:
    assert list(g711.ulaw_encode(EVERY_SAMPLE)) == [reference_ulaw_encode(s) for s in samples(EVERY_SAMPLE)]
    assert samples(g711.ulaw_decode(EVERY_CODE)) == [reference_ulaw_decode(c) for c in EVERY_CODE]


def test_alaw_matches_the_reference_for_every_sample_and_code() -> None:
    assert list(g711.alaw_encode(EVERY_SAMPLE)) == [reference_alaw_encode(s) for s in samples(EVERY_SAMPLE)]
    assert samples(g711.alaw_decode(EVERY_CODE)) == [reference_alaw_decode(c) for c in EVERY_CODE]


def test_code_points_the_standard_fixes() -> None:
    silence = np.zeros(4, dtype="<i2").tobytes()
    assert g711.ulaw_encode(silence) == b"\xff" * 4
    assert g711.alaw_encode(silence) == b"\xd5" * 4
    assert samples(g711.ulaw_decode(b"\x80\x00\xff\x7f")) == [32124, -32124, 0, 0]
    assert samples(g711.alaw_decode(b"\xaa\x2a\xd5\x55")) == [32256, -32256, 8, -8]


def audioop_or_none() -> ModuleType | None:
    """The stdlib's G.711 (deprecated in 3.11, gone in 3.13) as a second oracle while it exists."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return importlib.import_module("audioop")
        except ImportError:
            return None


def test_matches_audioop_where_it_exists() -> None:
    audioop = audioop_or_none()
    if audioop is None:
        pytest.skip("audioop is not in this Python; the reference tests above still cover every value")
    assert g711.ulaw_encode(EVERY_SAMPLE) == audioop.lin2ulaw(EVERY_SAMPLE, 2)
    assert g711.alaw_encode(EVERY_SAMPLE) == audioop.lin2alaw(EVERY_SAMPLE, 2)
    assert g711.ulaw_decode(EVERY_CODE) == audioop.ulaw2lin(EVERY_CODE, 2)
    assert g711.alaw_decode(EVERY_CODE) == audioop.alaw2lin(EVERY_CODE, 2)


def test_decode_then_encode_gives_the_code_back() -> None:
    # Every code but μ-law's negative zero (0x7F decodes to 0, which encodes as 0xFF) survives a round trip.
    assert g711.alaw_encode(g711.alaw_decode(EVERY_CODE)) == EVERY_CODE
    ulaw_round_trip = g711.ulaw_encode(g711.ulaw_decode(EVERY_CODE))
    assert [c for c, back in zip(EVERY_CODE, ulaw_round_trip, strict=True) if c != back] == [0x7F]


def test_empty_input_gives_empty_output() -> None:
    for codec in (g711.ulaw_decode, g711.ulaw_encode, g711.alaw_decode, g711.alaw_encode):
        assert codec(b"") == b""


@pytest.mark.parametrize("encode", [g711.ulaw_encode, g711.alaw_encode])
def test_odd_byte_count_is_refused_by_name(encode: Callable[[bytes], bytes]) -> None:
    with pytest.raises(RequestError, match="3 bytes; send a whole number of 2-byte samples"):
        encode(b"\x00\x01\x02")
