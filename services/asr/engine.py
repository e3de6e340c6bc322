"""The interface every ASR engine implements: one utterance's audio in, its text and word timings out.

Whisper is the engine here (`whisper_engine.py`); the recognition stream and the server only see this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class WordTiming:
    text: str
    start_s: float
    end_s: float
    probability: float


@dataclass(frozen=True)
class Transcript:
    text: str
    words: list[WordTiming] = field(default_factory=list)
    compute_ms: float = 0.0
    done_us: int = 0  # wall clock when the decode finished, epoch microseconds
    language: str = ""  # the language decoded: the one asked for, or the one the engine detected
    avg_logprob: float = 0.0
    """The decoder's mean log-probability per token (Whisper's own confidence; 0.0: not known)."""
    no_speech_prob: float = 0.0
    """The decoder's probability that the audio held no speech."""
    end_probability: float | None = None
    """The decoder's P that the utterance ends after its last word (a full stop, question or exclamation mark, or
    the end of the text next), which hears the voice's fall as well as the words (None: not asked or not known)."""


@dataclass(frozen=True)
class DecodeOptions:
    language: str = ""
    """Language code to decode in; empty: the engine's only language, or the one it detects."""
    trimmed: bool = True
    """Decode only the audio present (plus padding) rather than the engine's fixed window."""
    word_timings: bool = True
    end_probability: bool = False
    """Also give the decoder's P that the utterance ends after its last word (`Transcript.end_probability`)."""


@dataclass(frozen=True)
class TranscriberCapabilities:
    """What an engine can do; the server validates requests and picks decode options from these."""

    languages: frozenset[str]
    """Language codes it transcribes."""
    detects_language: bool
    """Picks the language itself when a request names none (else a request without one gets the only language)."""
    trimmed_decode: bool
    """Can decode a window trimmed to the audio; without it every decode is the full window."""
    word_timings: bool
    """Returns a timing per word."""
    sample_rate_hz: int = 16000
    """The rate its audio must be at."""

    def language_for(self, requested: str) -> str:
        """The language to decode `requested` in ("" = detect); ValueError naming the choices if unsupported."""
        if requested:
            if requested not in self.languages:
                choices = ", ".join(sorted(self.languages)) if len(self.languages) <= 8 else "a Whisper language code"
                raise ValueError(f"language={requested!r} unsupported by this model; send {choices} or leave it empty")
            return requested
        if self.detects_language:
            return ""
        if len(self.languages) == 1:
            return next(iter(self.languages))
        raise ValueError("language is required: this model does not detect it")


class Transcriber(Protocol):
    """Speech to text for one utterance at a time. Thread-safe: a worker pool calls it from several threads."""

    name: str
    capabilities: TranscriberCapabilities

    def transcribe(self, audio: np.ndarray, options: DecodeOptions | None = None) -> Transcript:
        """Decode float32 mono audio at `capabilities.sample_rate_hz` (at most 30 s); None: the defaults."""
        ...
