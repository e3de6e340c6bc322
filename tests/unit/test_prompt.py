"""How a dialogue becomes the completion prompt, and how the LLM service validates the messages it receives."""

import grpc
import pytest

from services.llm.engine import Message
from services.llm.prompt import CompletionPrompt
from services.llm.server import to_request
from voicemesh.errors import RequestError
from voicemesh.v1 import llm_pb2

HEARD = [Message("user", "Do you know what I did today?"), Message("assistant", "That is", interrupted=True)]


def test_an_interrupted_reply_is_a_narrators_line_not_an_assistant_line() -> None:
    prompt = CompletionPrompt().render([*HEARD, Message("user", "I went for a swim.")])
    lines = prompt.splitlines()
    assert lines[-4:] == [
        "User: Do you know what I did today?",
        '(The assistant began to say "That is" but the user interrupted.)',
        "User: I went for a swim.",
        "Assistant:",
    ]
    assert "Assistant: That is\n" not in prompt  # no Assistant line for the model to imitate


def test_the_same_text_not_interrupted_stays_an_assistant_line() -> None:
    prompt = CompletionPrompt().render([HEARD[0], Message("assistant", "That is"), Message("user", "Yes.")])
    assert "\nAssistant: That is\nUser: Yes.\nAssistant:" in prompt
    assert "interrupted" not in prompt


def test_the_fragment_is_kept_whitespace_normalized_and_braces_survive() -> None:
    note = CompletionPrompt().render([HEARD[0], Message("assistant", " {x}  and\n so", interrupted=True)])
    assert '(The assistant began to say "{x} and so" but the user interrupted.)' in note


def test_prompts_with_an_interrupted_reply_still_grow_by_appending() -> None:
    prompt = CompletionPrompt()
    with_note = prompt.render([*HEARD, Message("user", "I went for a swim.")])
    later = prompt.render(
        [*HEARD, Message("user", "I went for a swim."), Message("assistant", "Nice."), Message("user", "It was cold.")]
    )
    assert later.startswith(with_note)
    # The turn that was interrupted: its cue gives way to the narrator's line, the text before it is unchanged.
    before = prompt.render(HEARD[:1])
    assert with_note.startswith(before.removesuffix("Assistant:"))


def _request(*messages: llm_pb2.ChatMessage) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(session_id="s", messages=list(messages))


def test_interrupted_is_carried_into_the_engine_request() -> None:
    request = to_request(
        _request(
            llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content="Hi"),
            llm_pb2.ChatMessage(role=llm_pb2.ROLE_ASSISTANT, content="That is", interrupted=True),
            llm_pb2.ChatMessage(role=llm_pb2.ROLE_ASSISTANT, content="Hello."),
            llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content="Bye"),
        )
    )
    assert [m.interrupted for m in request.messages] == [False, True, False, False]
    assert request.messages[1] == Message("assistant", "That is", interrupted=True)


@pytest.mark.parametrize(("role", "name"), [(llm_pb2.ROLE_USER, "ROLE_USER"), (llm_pb2.ROLE_SYSTEM, "ROLE_SYSTEM")])
def test_interrupted_on_a_message_not_from_the_assistant_is_invalid(role: int, name: str) -> None:
    with pytest.raises(RequestError) as error:
        to_request(
            _request(
                llm_pb2.ChatMessage(role=role, content="Hi", interrupted=True),
                llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content="Hello?"),
            )
        )
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"messages[0].interrupted is set on a {name} message" in error.value.message
    assert "only a ROLE_ASSISTANT reply" in error.value.message
