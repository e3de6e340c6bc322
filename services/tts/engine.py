"""The interface every TTS engine implements: text in, float32 audio out, a piece (a sentence) at a time.

Piper is the engine here (`piper_engine.py`); the synthesis stream and the server only see this.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Voice:
    name: str
    sample_rate_hz: int
    """The rate it speaks at; the stream resamples to the rate a caller asks for."""
    language: str = ""
    """Language and region code, e.g. en_US."""


@dataclass(frozen=True)
class SynthesizerCapabilities:
    """What an engine can do; the server validates requests and resamples from these."""

    voices: tuple[Voice, ...]
    """Voices a stream may ask for; the first is the default."""

    def voice(self, name: str) -> Voice:
        """The voice called `name` ("" = the default); ValueError listing the voices otherwise."""
        if not name:
            return self.voices[0]
        for voice in self.voices:
            if voice.name == name:
                return voice
        names = ", ".join(repr(voice.name) for voice in self.voices)
        raise ValueError(f"voice={name!r} unknown; available: {names} (or empty for {self.voices[0].name!r})")


class Synthesizer(Protocol):
    """Speech for text. Thread-safe: a worker pool calls it from several threads."""

    capabilities: SynthesizerCapabilities

    def synthesize(self, text: str, voice: str = "", urgent: bool = False) -> Iterator[np.ndarray]:
        """Audio for `text` in `voice` ("" = the default): float32 mono at the voice's rate, piece by piece.
        `urgent`: a listener waits for it (a reply's first chunk); an engine may give it more cores."""
        ...
