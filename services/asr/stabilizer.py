"""LocalAgreement for partial transcripts: the words two consecutive passes agree on become stable."""

from __future__ import annotations

import re

_NORMALIZE = re.compile(r"[^\w']+")


def _key(word: str) -> str:
    return _NORMALIZE.sub("", word.lower())


class LocalAgreement:
    """Tracks one turn's hypotheses; the stable prefix only grows until `reset`."""

    def __init__(self) -> None:
        self._previous: list[str] = []
        self._stable: list[str] = []

    def update(self, text: str) -> str:
        """Add a new hypothesis; returns the stable prefix (words agreed by this and the previous pass)."""
        words = text.split()
        agreed = 0
        for old, new in zip(self._previous, words, strict=False):
            if _key(old) != _key(new):
                break
            agreed += 1
        if agreed > len(self._stable):
            self._stable = words[:agreed]
        self._previous = words
        return " ".join(self._stable)

    def reset(self) -> None:
        self._previous = []
        self._stable = []
