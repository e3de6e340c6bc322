from services.llm.engine import Message
from services.llm.prompt import CompletionPrompt

PROMPT = CompletionPrompt()


def offset_words(text: str) -> str | None:
    rendered = PROMPT.render([Message("user", "Hi."), Message("assistant", "Hello."), Message("user", text)])
    offset = PROMPT.turn_end_offset(rendered)
    return None if offset is None else rendered[:offset].rsplit("\n", 1)[-1]


def test_the_score_point_is_after_the_last_word_before_any_closing_punctuation() -> None:
    assert offset_words("The child almost hurt.") == "User: The child almost hurt"
    assert offset_words("Is it   raining?  ") == "User: Is it raining"
    assert offset_words('He said "go..."') == 'User: He said "go'
    assert offset_words("And so,") == "User: And so"


def test_no_score_point_without_words_or_with_a_reply_prefix() -> None:
    assert offset_words("...") is None
    rendered = PROMPT.render([Message("user", "Hello there.")], reply_prefix="Hi")
    assert PROMPT.turn_end_offset(rendered) is None
