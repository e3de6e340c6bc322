"""Speech the decode left out: WhisperTranscriber decodes the sound after its last word on its own and appends the
words (a decoder stub stands in for Whisper; the decode's own behaviour is the integration tests')."""

from __future__ import annotations

import numpy as np

from services.asr.engine import DecodeOptions, Transcript, WordTiming
from services.asr.whisper_engine import UNHEARD_WITHIN_DB, WhisperTranscriber
from voicemesh.audio import speech_end_ms

RATE = 16000


def _tone(seconds: float, level: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (level * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def _quiet(seconds: float) -> np.ndarray:
    return np.random.default_rng(1).normal(0, 1e-4, int(seconds * RATE)).astype(np.float32)


class FakeDecoder(WhisperTranscriber):
    """Hears `heard` words in the first decode; a later one (of the audio after them) hears `rest`."""

    def __init__(self, heard: list[WordTiming], rest: list[WordTiming]) -> None:  # no model is loaded
        self.heard, self.rest, self.decoded_s = heard, rest, []

    def decode_once(self, audio: np.ndarray, options: DecodeOptions) -> Transcript:
        self.decoded_s.append(len(audio) / RATE)
        words = self.heard if len(self.decoded_s) == 1 else self.rest
        return Transcript(" ".join(w.text for w in words), list(words), avg_logprob=-0.2)


def _speech_then_more(first_s: float, gap_s: float, more_s: float) -> np.ndarray:
    return np.concatenate([_quiet(0.2), _tone(first_s), _quiet(gap_s), _tone(more_s), _quiet(0.3)])


def test_speech_after_the_last_word_is_decoded_and_appended_in_place() -> None:
    audio = _speech_then_more(1.0, 0.1, 0.6)  # words end at 1.2 s; sound goes on from 1.3 to 1.9 s
    heard = [WordTiming("let", 0.2, 0.7, 0.9), WordTiming("you", 0.7, 1.2, 0.9)]
    rest = [
        WordTiming("you", 0.0, 0.05, 0.9),
        WordTiming("know.", 0.1, 0.7, 0.9),
    ]  # its first word is the last one again
    decoder = FakeDecoder(heard, rest)
    transcript = decoder.transcribe(audio)
    assert transcript.text == "let you know."
    assert [round(w.start_s, 2) for w in transcript.words] == [0.2, 0.7, 1.3]
    assert abs(decoder.decoded_s[1] - (len(audio) / RATE - 1.2)) < 0.01, "the rest starts at the last word's end"


def test_a_decode_that_heard_everything_is_not_decoded_again() -> None:
    audio = np.concatenate([_quiet(0.2), _tone(1.0), _quiet(0.5)])
    decoder = FakeDecoder([WordTiming("done.", 0.2, 1.2, 0.9)], [WordTiming("ghost", 0.0, 0.2, 0.9)])
    assert decoder.transcribe(audio).text == "done."
    assert len(decoder.decoded_s) == 1


def test_partials_without_word_timings_are_decoded_once() -> None:
    audio = _speech_then_more(1.0, 0.1, 0.6)
    decoder = FakeDecoder([WordTiming("let", 0.2, 1.2, 0.9)], [WordTiming("know", 0.0, 0.5, 0.9)])
    decoder.transcribe(audio, DecodeOptions(word_timings=False))
    assert len(decoder.decoded_s) == 1


def test_speech_end_counts_sound_not_a_quiet_room() -> None:
    audio = _speech_then_more(1.0, 0.2, 0.5)  # sound 0.2-1.2 s and 1.4-1.9 s
    assert abs(speech_end_ms(audio, RATE, UNHEARD_WITHIN_DB) - 1900) < 20
    faint = np.concatenate([_quiet(0.2), _tone(1.0), _tone(0.6, level=0.3 * 10 ** (-40 / 20))])  # a breath, -40 dB
    assert abs(speech_end_ms(faint, RATE, UNHEARD_WITHIN_DB) - 1200) < 20
    assert speech_end_ms(np.zeros(RATE, dtype=np.float32), RATE) == 0.0
