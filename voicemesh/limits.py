"""Request limits that more than one process checks (the gateway up front, the service again): one definition
each, with the check and its message."""

from __future__ import annotations

from dataclasses import dataclass

from voicemesh.errors import invalid, out_of_range


@dataclass(frozen=True)
class Range:
    """An integer field where 0 means the default."""

    low: int
    high: int
    default: int

    def resolve(self, value: int, field: str) -> int:
        """`value`, or the default for 0; OUT_OF_RANGE naming `field` and the range otherwise."""
        value = value or self.default
        if not self.low <= value <= self.high:
            raise out_of_range(f"{field}={value} out of range; send {self.low}-{self.high} (or 0 for {self.default})")
        return value


@dataclass(frozen=True)
class Rates:
    """Sample rates a field may take; `default` (if any) stands for 0."""

    allowed: tuple[int, ...]
    default: int = 0

    def check(self, value: int, field: str) -> int:
        """The rate to use; INVALID_ARGUMENT naming `field` and the allowed rates otherwise."""
        rate = value or self.default
        if rate not in self.allowed:
            choices = ", ".join(map(str, self.allowed))
            zero = f" (or 0 for {self.default})" if self.default else ""
            raise invalid(f"{field}={value} unsupported; send one of {choices}{zero}")
        return rate


MAX_TOKENS = Range(1, 512, 48)
"""Tokens one reply may generate."""
URGENT_WORDS = Range(1, 32, 4)
"""Words at the start of a reply that a listener waits for: an LLM replica does not hand its slot on before them."""
LOOKAHEAD_WORDS = Range(1, 4, 2)
"""Words the TTS waits for beyond a chunk before synthesizing it (a 1-2 word lookahead keeps prosody)."""
INPUT_RATES = Rates((8000, 16000, 22050, 24000, 32000, 44100, 48000))
"""Rates of the user's audio: telephony's 8 kHz, the ASR's own 16 kHz, and the rates sound cards and browsers run at
(a page whose AudioContext runs at 44.1 kHz sends that). The ASR resamples each stream to 16 kHz as it arrives."""
OUTPUT_RATES = Rates((8000, 16000, 22050, 24000, 48000), default=16000)
"""Rates of the reply audio (the TTS resamples its voice to it); 8 kHz for a phone call."""
