"""Whisper's own P(the utterance ends after its last word), on the real tiny.en model: what the ASR fuses into the end of
turn beside the LLM's score."""

from __future__ import annotations

import numpy as np
import pytest

from services.asr.engine import DecodeOptions
from services.asr.whisper_engine import WhisperTranscriber
from tests.conftest import load_clip, needs_human_speech

pytestmark = pytest.mark.integration

PAUSE = np.zeros(512, dtype=np.float32)  # the first silent window of a pause, as the ASR decodes the draft


@pytest.fixture(scope="module")
def whisper() -> WhisperTranscriber:
    return WhisperTranscriber(cpu_threads=1)


def test_whisper_hears_the_end_of_a_sentence_and_not_a_stop_inside_it(whisper: WhisperTranscriber) -> None:
    needs_human_speech("spk1_snt1", "a person's voice falls at the end; Piper's reading varies run to run")
    audio = load_clip("spk1_snt1").to_rate(16000).samples  # "The child almost hurt the small dog."
    words = whisper.transcribe(audio).words
    assert len(words) == 7, [w.text for w in words]
    ask = DecodeOptions(end_probability=True)
    finished = whisper.transcribe(np.concatenate([audio[: int((words[-1].end_s + 0.12) * 16000)], PAUSE]), ask)
    inside = [
        whisper.transcribe(np.concatenate([audio[: int((words[k].end_s + 0.03) * 16000)], PAUSE]), ask)
        for k in (2, 3)  # "The child almost" | "The child almost hurt"
    ]
    assert finished.end_probability is not None and finished.end_probability > 0.6, finished
    for cut in inside:
        assert cut.end_probability is not None and cut.end_probability < 0.5, cut
    assert whisper.transcribe(audio).end_probability is None, "not asked: not computed"
