"""What the turn policy makes of a transcript's words (voicemesh.evaluation.words_of): a backchannel, one user line."""

from __future__ import annotations

import re

DEFAULT_BACKCHANNELS = frozenset(
    {
        "yeah", "yes", "yep", "yup", "ok", "okay", "right", "sure", "alright", "all right", "uh-huh", "mm-hmm", "mhm",
        "mm", "hmm", "hm", "uh", "um", "ah", "oh", "aha", "huh", "i see", "got it", "i know", "gotcha", "cool",
        "nice", "wow", "true", "exactly", "of course", "sounds good", "makes sense", "that's right",
    }
)  # fmt: skip
_VOCALIZATION = re.compile(r"[mh]*m[mh]*(?:-[mh]*m[mh]*)*|u+h*m*|u+h+-?h+u+h+|a+h+|o+h+|e+r+m*|e+h+")
"""A hum or hesitation sound however Whisper spells it ("mm-m-m", "mmhmm", "m", "hmmm", "uhm", "ahh", "erm"): not a
word, and never an interruption. Whisper writes the same "mm-hmm" a different way from one decode to the next."""


def continue_line(before: str, after: str) -> str:
    """One user line from the words before a pause and the words after it. Whisper's full stop before words that go
    on in lower case marked the pause, not the end of a sentence."""
    before, after = before.strip(), after.strip()
    if not after:
        return before
    if before.endswith(".") and after[:1].islower():
        before = before[:-1]
    return f"{before} {after}" if before else after


def is_backchannel(words: list[str], backchannels: frozenset[str]) -> bool:
    """True when every word, or every adjacent pair ("i see"), is an acknowledgement or a vocalization."""
    index = 0
    while index < len(words):
        if index + 1 < len(words) and f"{words[index]} {words[index + 1]}" in backchannels:
            index += 2
        elif words[index] in backchannels or _VOCALIZATION.fullmatch(words[index]):
            index += 1
        else:
            return False
    return bool(words)
