"""The marks a phone door sends after each chunk of a reply and the carrier echoes once the audio before it has
played: which chunk each stands for, which came back, and which are overdue."""

from __future__ import annotations

import collections
from dataclasses import dataclass

MARK_TIMEOUT_S = 3.0  # past its audio's due time, a mark that has not come back is taken as never heard


@dataclass(frozen=True)
class SentMark:
    name: str
    turn_index: int
    text: str
    """The chunk of the reply whose last audio the mark follows."""
    due_s: float
    """On the door's clock: when the carrier should have echoed it, at the latest."""


class MarkLedger:
    """Marks sent and not yet echoed, in the order sent (the carrier echoes them in that order)."""

    def __init__(self) -> None:
        self._sent: collections.OrderedDict[str, SentMark] = collections.OrderedDict()
        self._count = 0
        self.unknown = 0
        """Echoes of marks this door did not send, or sent for a turn that was cleared."""

    def __len__(self) -> int:
        return len(self._sent)

    def add(self, turn_index: int, text: str, due_s: float) -> str:
        """A mark for a chunk whose last frame was just sent; returns its name."""
        self._count += 1
        name = f"t{turn_index}c{self._count}"
        self._sent[name] = SentMark(name, turn_index, text, due_s)
        return name

    def echoed(self, name: str) -> SentMark | None:
        """The mark that came back (None: not one of ours, or of a cleared turn)."""
        mark = self._sent.pop(name, None)
        if mark is None:
            self.unknown += 1
        return mark

    def clear_turn(self, turn_index: int) -> int:
        """Forget the marks of a turn whose audio was cleared: their echoes say nothing was heard. Returns how many."""
        cleared = [name for name, mark in self._sent.items() if mark.turn_index <= turn_index]
        for name in cleared:
            del self._sent[name]
        return len(cleared)

    def overdue(self, now_s: float) -> list[SentMark]:
        """Take out the marks past their due time."""
        late = [mark for mark in self._sent.values() if mark.due_s <= now_s]
        for mark in late:
            del self._sent[mark.name]
        return late
