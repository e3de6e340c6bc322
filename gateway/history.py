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


class TurnEntries:
    """The history entries of a session's recent turns, so that a client can change what one of them says (what it
    heard of a reply, a deleted line). Entries are found by identity: trimming the history moves them."""

    KEPT_TURNS = 64

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], HistoryEntry] = {}

    def note(self, turn_index: int, entry: HistoryEntry) -> None:
        self._entries[(turn_index, entry.role)] = entry
        while len(self._entries) > 2 * self.KEPT_TURNS:
            self._entries.pop(next(iter(self._entries)))

    def replace(self, history: list[HistoryEntry], turn_index: int, role: str, text: str | None) -> bool:
        """Make the turn's `role` line say `text` (marked as cut short), or remove it (None); False if it is not in
        the history (any more)."""
        entry = self._entries.pop((turn_index, role), None)
        index = next((i for i, kept in enumerate(history) if kept is entry), None)
        if entry is None or index is None:
            return False
        if text is None or not text.strip():
            del history[index]
        else:
            history[index] = HistoryEntry(role, text, interrupted=role == "assistant")
            self._entries[(turn_index, role)] = history[index]
        return True


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
