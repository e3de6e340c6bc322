"""Turn-end examples from dialogue corpora, and the features the served model gives them: what
`python -m services.llm.train_turn_probe` learns the turn-end probe from.

Every word end inside a user's line is a "goes on" example and the line's last word a "finished" one, each scored with
the dialogue so far in the live prompt's format (persona, examples, earlier lines). The text is what the live
transcript gives at a pause: the line up to that word, its closing punctuation left out.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.llm.prompt import CLOSING

FILLERS = ("um", "uh", "uhm", "er")
"""Filled pauses as Whisper writes the few it keeps; a line cut after one goes on."""


@dataclass(frozen=True)
class Dialogue:
    """One dialogue: its corpus, id, and its lines as (role, text), role "user" or "assistant"."""

    corpus: str
    dialogue_id: str
    lines: tuple[tuple[str, str], ...]


def sgd_dialogues(directory: Path) -> Iterator[Dialogue]:
    """The Schema-Guided Dialogue dataset's dialogues (`dialogues_NNN.json` files under `directory`)."""
    for path in sorted(directory.glob("dialogues_*.json")):
        for item in json.loads(path.read_text()):
            lines = tuple(
                ("user" if turn["speaker"] == "USER" else "assistant", turn["utterance"]) for turn in item["turns"]
            )
            yield Dialogue("sgd", item["dialogue_id"], lines)


def taskmaster_dialogues(directory: Path) -> Iterator[Dialogue]:
    """Taskmaster-4's dialogues (`data_NN.json` files under `directory`)."""
    for path in sorted(directory.glob("data_*.json")):
        for item in json.loads(path.read_text()):
            lines = tuple(
                ("user" if turn["speaker"] == "user" else "assistant", turn["text"]) for turn in item["utterances"]
            )
            yield Dialogue("tm4", item["conversation_id"], lines)


_WORD_END = re.compile(r"[\w')\]%$]+(?=[^\w']|$)")


def clean(text: str) -> str:
    """A line as one line of single-spaced text."""
    return " ".join(text.split())


def word_ends(line: str) -> list[int]:
    """The offsets in `line` right after each word, before any punctuation that follows it (what the live scorer
    sees at a pause after that word: `CompletionPrompt.turn_end_offset` strips the same closing punctuation)."""
    ends = []
    for match in _WORD_END.finditer(line):
        end = match.end()
        while end > 0 and line[end - 1] in CLOSING:
            end -= 1
        if end > match.start() and any(ch.isalnum() for ch in line[match.start() : end]):
            ends.append(end)
    return ends


def with_filler(line: str, rng: random.Random) -> tuple[str, int] | None:
    """`line` with a filled pause inserted after one of its inner words ("I want, um, a table"), and the offset
    right after the filler (a point where the line goes on); None for lines of fewer than three words."""
    ends = word_ends(line)
    if len(ends) < 3:
        return None
    at = ends[rng.randrange(len(ends) - 1)]
    filler = rng.choice(FILLERS)
    text = f"{line[:at]}, {filler}, {line[at:].lstrip(',').lstrip()}"
    return text, at + 2 + len(filler)
