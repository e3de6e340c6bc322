"""The one word normaliser (what counts as a word of a transcript, for the turn policy, the ASR and the tests), and
word error rate."""

from __future__ import annotations

import re

_ANNOTATION = re.compile(r"\[[^\]]*\]|\([^)]*\)|\*[^*]*\*")  # Whisper's "[cough]", "(laughs)": not words
_WORD = re.compile(r"[a-z0-9']+(?:-[a-z0-9']+)*")


def words_of(text: str) -> list[str]:
    """The spoken words of a transcript: lower case, no punctuation, no "[cough]"-style annotations."""
    return _WORD.findall(_ANNOTATION.sub(" ", text.lower()))


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Levenshtein distance over normalised words, divided by the reference length."""
    ref, hyp = words_of(reference), words_of(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    previous = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        current = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h))
        previous = current
    return previous[-1] / len(ref)
