import pytest

from services.asr.stabilizer import LocalAgreement
from services.asr.whisper_engine import clean_tail, collapse_repetition
from services.llm.engine import Message
from services.llm.prompt import CompletionPrompt
from services.tts.chunking import Chunker, Policy
from voicemesh.evaluation import word_error_rate


def test_local_agreement_grows_only_with_agreement() -> None:
    agreement = LocalAgreement()
    assert agreement.update("and so") == ""
    assert agreement.update("And so my") == "And so"
    assert agreement.update("and so my fellow") == "and so my"
    assert agreement.update("and so we") == "and so my"  # never shrinks within a turn
    agreement.reset()
    assert agreement.update("ask not") == ""


def test_words_chunking_releases_first_chunk_after_lookahead_words() -> None:
    chunker = Chunker(Policy.WORDS, lookahead=2)
    assert chunker.push("Sure") == []
    assert chunker.push(" thing") == []  # "thing" may still grow: not a complete word yet
    assert chunker.push(" I") == ["Sure thing"]
    assert chunker.push(" can help you with that") == ["I can help you"]  # the next chunk: twice the words
    assert chunker.push(". Bye") == ["with that."]  # or earlier, at punctuation
    assert chunker.flush() == ["Bye"]


def test_each_later_chunk_doubles_up_to_twelve_words_and_a_new_utterance_starts_short_again() -> None:
    chunker = Chunker(Policy.WORDS, lookahead=1)
    chunks = []
    for index in range(40):
        chunks += chunker.push(f"w{index} ")
    assert [len(chunk.split()) for chunk in chunks] == [1, 2, 4, 8, 12, 12]
    chunker.flush()
    assert chunker.push("next reply ") == ["next"], "each reply's first chunk is short: its listener waits"


def test_sentence_and_whole_chunking() -> None:
    sentence = Chunker(Policy.SENTENCE)
    assert sentence.push("Hello there, friend. How") == ["Hello there, friend."]
    assert sentence.flush() == ["How"]
    whole = Chunker(Policy.WHOLE)
    assert whole.push("Hello there. How are you? ") == []
    assert whole.flush() == ["Hello there. How are you?"]


def test_chunks_concatenate_to_the_input() -> None:
    chunker = Chunker(Policy.WORDS, lookahead=1)
    text = "One, two three four five six seven eight nine ten eleven twelve thirteen fourteen. Done!"
    chunks = []
    for token in text.split(" "):
        chunks += chunker.push(token + " ")
    chunks += chunker.flush()
    assert " ".join(chunks) == text


@pytest.mark.parametrize("lookahead", [0, 5])
def test_lookahead_out_of_range(lookahead: int) -> None:
    with pytest.raises(ValueError):
        Chunker(Policy.WORDS, lookahead)


def test_collapse_repetition() -> None:
    loop = "And so my fellow Americans. And so my fellow Americans. And so my".split()
    assert collapse_repetition(loop) == "And so my fellow Americans.".split()
    assert collapse_repetition("S S S S".split()) == ["S"]
    tail = "The horizon seems extremely distant. The horizon seems extremely distant. and".split()
    assert collapse_repetition(tail) == "The horizon seems extremely distant.".split()
    restart = "ask what you can do for your country. Ask what you".split()
    assert collapse_repetition(restart) == "ask what you can do for your country.".split()
    assert collapse_repetition("no no".split()) == ["no", "no"]  # a real double word stays
    real = "ask what you can do for your country".split()
    assert collapse_repetition(real) == real


def test_prompt_is_plain_completion_that_grows_by_appending() -> None:
    prompt = CompletionPrompt()
    first = prompt.render([Message("user", "Hi there")])
    second = prompt.render(
        [Message("user", "Hi there"), Message("assistant", "Hello!"), Message("user", "How are you?")]
    )
    assert first.endswith("User: Hi there\nAssistant:")
    assert second.startswith(first)  # the prefix cache depends on this
    assert "<start_of_turn>" not in second


def test_word_error_rate() -> None:
    assert word_error_rate("The child almost hurt the small dog.", "the child almost hurt the small dog") == 0
    assert word_error_rate("a b c d", "a x c") == 0.5


def test_clean_tail_drops_a_dangling_word_after_a_sentence_end() -> None:
    assert (
        clean_tail("The horizon seems extremely distant. and".split()) == "The horizon seems extremely distant.".split()
    )
    assert clean_tail("ask what you can do".split()) == "ask what you can do".split()
    assert clean_tail("Yes. Okay.".split()) == ["Yes.", "Okay."]
