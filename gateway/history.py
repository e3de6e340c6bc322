"""The dialogue a session keeps (what was said aloud), its bound, and the prompt it makes for the LLM."""

from __future__ import annotations

from dataclasses import dataclass

from voicemesh.v1 import llm_pb2

ROLE = {"user": llm_pb2.ROLE_USER, "assistant": llm_pb2.ROLE_ASSISTANT}


@dataclass(frozen=True)
class HistoryEntry:
    """One utterance of the dialogue as it was heard."""

    role: str  # "user" or "assistant"
    text: str
    interrupted: bool = False  # an assistant reply the user spoke over: `text` is only what was heard


def trim_history(history: list[HistoryEntry], max_chars: int) -> None:
    """Past `max_chars` of text, drop the oldest turns (in place) down to half of it. Dropping half at once keeps the
    prompt's prefix, and so the LLM's prefix cache, the same for many turns, where dropping one turn at a time would
    change it every turn."""
    if sum(len(entry.text) for entry in history) > max_chars:
        drop_oldest(history, max_chars // 2)


def drop_oldest(history: list[HistoryEntry], keep_chars: int) -> None:
    """Drop the oldest turns (in place) until at most `keep_chars` of text remain, starting again at a user's
    utterance (the latest turn is always kept)."""
    total = sum(len(entry.text) for entry in history)
    drop = 0
    while drop < len(history) - 1 and (total > keep_chars or history[drop].role != "user"):
        total -= len(history[drop].text)
        drop += 1
    del history[:drop]


def prompt_messages(system_prompt: str, history: list[HistoryEntry], user_text: str) -> list[llm_pb2.ChatMessage]:
    """The dialogue for the LLM: the system prompt, the history, and `user_text` as the user's line."""
    messages = []
    if system_prompt:
        messages.append(llm_pb2.ChatMessage(role=llm_pb2.ROLE_SYSTEM, content=system_prompt))
    messages += [
        llm_pb2.ChatMessage(role=ROLE[entry.role], content=entry.text, interrupted=entry.interrupted)
        for entry in history
    ]
    messages.append(llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content=user_text))
    return messages
