"""The ASR's pieces of end-of-turn: the transcript's completeness, the level normalizer, the repeated-tail fix."""

from __future__ import annotations

import numpy as np
import pytest

from services.asr.completeness import Fusion, text_completeness
from services.asr.stream import Loudness
from services.asr.whisper_engine import drop_repeated_tail, drop_restart, tidy
from voicemesh.endpointing import EndpointingPolicy


@pytest.mark.parametrize(
    ("text", "complete"),
    [
        ("The horizon seems extremely distant.", True),
        ("Is it raining?", True),
        ("We are sure that what...", False),
        ("The child almost hurt the", False),
        ("He began a confused complaint against the wizard,", False),
        ("I went to the shop and", False),
    ],
)
def test_the_transcript_ending_reads_as_complete_or_not(text: str, complete: bool) -> None:
    score = text_completeness(text)
    assert score is not None and (score >= 0.5) is complete


def test_no_words_means_no_text_score_and_the_other_signal_decides() -> None:
    assert text_completeness("") is None and text_completeness("...") is None
    fusion = Fusion(audio_weight=0.5)
    assert fusion.score(0.9, None) == 0.9
    assert fusion.score(None, 0.2) == 0.2
    assert fusion.score(None, None) is None
    assert fusion.score(1.0, 0.0) == pytest.approx(0.5)


def test_the_hangover_grows_as_the_score_falls() -> None:
    policy = EndpointingPolicy()
    waits = [policy.hangover_for(score) for score in (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)]
    assert waits == sorted(waits)
    assert waits[0] == policy.min_hangover_ms and waits[-1] == policy.max_hangover_ms
    assert policy.hangover_for(None) == policy.hangover_ms
    assert EndpointingPolicy(fixed_hangover=True).hangover_for(1.0) == policy.hangover_ms


def test_a_quiet_speaker_reaches_the_vad_at_a_normal_level_and_silence_stays_quiet() -> None:
    loudness = Loudness()
    speech = (0.003 * np.sin(np.arange(512) * 0.2)).astype(np.float32)  # about -53 dBFS: a distant laptop mic
    for _ in range(20):
        assert not loudness.quiet(speech)
        boosted = loudness.normalize(speech)
    level = 10 * np.log10(np.mean(boosted.astype(np.float64) ** 2))
    assert -30 < level < -15
    assert loudness.quiet(np.zeros(512, np.float32))


def test_a_loud_speaker_reaches_the_vad_at_the_same_level_as_a_normal_one() -> None:
    loudness = Loudness()
    speech = (0.6 * np.sin(np.arange(512) * 0.2)).astype(np.float32)  # about -7 dBFS: a close, hot microphone
    loudness.quiet(speech)
    level = 10 * np.log10(np.mean(loudness.normalize(speech).astype(np.float64) ** 2))
    assert level == pytest.approx(Loudness.TARGET_DBFS, abs=0.5)
    at_target = (0.1 * np.sin(np.arange(512) * 0.2)).astype(np.float32)  # -23 dBFS: within reach, left alone
    fresh = Loudness()
    fresh.level_dbfs = Loudness.TARGET_DBFS
    assert fresh.normalize(at_target) is at_target


def test_whisper_starting_the_utterance_over_is_undone() -> None:
    def said(text: str) -> str:
        return " ".join(drop_restart(text.split()))

    # Seen on finals of finished sentences read by Piper: the restart made the LLM wait the long hangover.
    assert (
        said("We missed the train because the taxi was late. We missed")
        == "We missed the train because the taxi was late."
    )
    assert said("The hogs were fed chopped corn and garbage. The h") == "The hogs were fed chopped corn and garbage."
    assert (
        said("Is it safe to leave my bike outside overnight? Is it") == "Is it safe to leave my bike outside overnight?"
    )
    # The start of the last sentence, too.
    assert said("The soup is bland. So what should I add? So what") == "The soup is bland. So what should I add?"
    # Anything else after the sentence end is speech, kept.
    for kept in ("Hi. Hi there", "I am done. I think so", "Let me think. Let us go", "We missed the train", "No. No"):
        assert said(kept) == kept
    # In the full cleanup, after the loop and tail repairs; a 3-word restart is a loop already.
    assert (
        " ".join(tidy("Ask not what your country can do. Ask not what".split())) == "Ask not what your country can do."
    )


def test_whisper_repeating_the_end_of_the_utterance_is_undone() -> None:
    words = "Remember to lock the door before you go out before you go".split()
    assert " ".join(drop_repeated_tail(words)) == "Remember to lock the door before you go out"
    assert drop_repeated_tail("that is that is".split()) == ["that", "is"]
    kept = "ask not what your country can do for you, ask what you can do for your country.".split()
    assert drop_repeated_tail(kept) == kept
    assert drop_repeated_tail("I said no no".split()) == "I said no no".split()  # one word twice is speech
    assert drop_repeated_tail("I said no, no, no.".split()) == "I said no, no, no.".split()  # three times too
    looped = "The child almost hurt the small dog. Umm. Umm. Umm. Umm. Umm. Umm.".split()
    assert " ".join(drop_repeated_tail(looped)) == "The child almost hurt the small dog. Umm."
