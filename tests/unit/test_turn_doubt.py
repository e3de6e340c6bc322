"""The ASR's own doubt about a draft transcript overrules a language model that calls it finished."""

from services.asr.completeness import doubted
from services.asr.engine import Transcript, WordTiming


def test_a_clear_finished_line_is_not_doubted() -> None:
    words = [WordTiming("Book", 0.0, 0.3, 0.95), WordTiming("a", 0.3, 0.4, 0.9), WordTiming("table.", 0.4, 0.8, 0.9)]
    assert doubted(Transcript("Book a table.", words, avg_logprob=-0.2, no_speech_prob=0.01)) is None
    assert doubted(Transcript("Yes.", [WordTiming("Yes.", 0.0, 0.3, 0.9)], avg_logprob=-0.1)) is None


def test_fillers_and_empty_lines_never_look_finished() -> None:
    assert doubted(Transcript("")) == "no_words"
    assert doubted(Transcript("...")) == "no_words"
    assert doubted(Transcript("Um.")) == "fillers_only"
    assert doubted(Transcript("Uh, um.")) == "fillers_only"
    assert doubted(Transcript("Mm-hmm.")) is None, "a hum is a whole answer"
    assert doubted(Transcript("I would like the small dog, um.")) == "ends_in_filler"


def test_a_garbled_decode_never_looks_finished() -> None:
    assert doubted(Transcript("Tor nacht fleer.", avg_logprob=-1.4)) == "low_confidence"
    # Whisper's no-speech probability at a pause is as high after finished lines as inside them (0037): no veto.
    assert doubted(Transcript("Thank you.", avg_logprob=-0.3, no_speech_prob=0.8)) is None
    assert doubted(Transcript("Blarg.", [WordTiming("Blarg.", 0.0, 0.4, 0.2)], avg_logprob=-0.5)) == "one_unsure_word"
