"""When streamed reply text is handed to the synthesizer: per sentence, per few words, or whole."""

from __future__ import annotations

import enum
import re

from voicemesh.limits import LOOKAHEAD_WORDS

_SENTENCE_END = re.compile(r"[.!?;:](?:[\"')\]]*)\s")
_CLAUSE_END = re.compile(r"[.!?;:,](?:[\"')\]]*)\s")
_MAX_WORDS = 12


class Policy(enum.Enum):
    SENTENCE = "sentence"
    WORDS = "words"
    WHOLE = "whole"


class Chunker:
    """Buffers text deltas and releases speakable chunks.

    - SENTENCE: at each sentence end (. ! ? ; :) followed by whitespace.
    - WORDS: the first chunk as soon as `lookahead` complete words are there (a word is complete once the
      next delta starts a new one), or earlier at punctuation; each later chunk at clause punctuation or at
      twice the words of the one before, up to 12. The first chunk is what the listener waits for; later ones
      are synthesized while earlier audio plays, so they can be longer, which sounds better. They grow
      gradually because each must be written and synthesized while the one before plays: a two-word first
      chunk (~0.5 s of audio) followed at once by a 12-word one left the listener in silence whenever the LLM
      or the TTS was shared with other sessions.
    - WHOLE: only on flush.
    """

    def __init__(self, policy: Policy, lookahead: int = LOOKAHEAD_WORDS.default) -> None:
        if not LOOKAHEAD_WORDS.low <= lookahead <= LOOKAHEAD_WORDS.high:
            raise ValueError(f"lookahead must be {LOOKAHEAD_WORDS.low}-{LOOKAHEAD_WORDS.high} words")
        self.policy = policy
        self.lookahead = lookahead
        self._buffer = ""
        self._limit = lookahead  # words of the next chunk, unless punctuation comes first

    def push(self, text: str) -> list[str]:
        """Add a delta; returns the chunks now ready (possibly none)."""
        self._buffer += text
        ready: list[str] = []
        while (cut := self._cut()) is not None:
            chunk, self._buffer = self._buffer[:cut].strip(), self._buffer[cut:].lstrip()
            if chunk:
                ready.append(chunk)
                self._limit = min(2 * self._limit, _MAX_WORDS)
        return ready

    def flush(self) -> list[str]:
        """End of the utterance: whatever is buffered."""
        chunk, self._buffer = self._buffer.strip(), ""
        self.reset()
        return [chunk] if chunk else []

    def reset(self) -> None:
        self._buffer = ""
        self._limit = self.lookahead

    def _cut(self) -> int | None:
        if self.policy is Policy.WHOLE:
            return None
        if self.policy is Policy.SENTENCE:
            match = _SENTENCE_END.search(self._buffer)
            return match.end() if match else None
        match = _CLAUSE_END.search(self._buffer)
        # Complete words: followed by whitespace (the word being generated might still grow).
        complete = [m.end() for m in re.finditer(r"\S+\s", self._buffer)]
        limit = self._limit
        by_count = complete[limit - 1] if len(complete) >= limit else None
        candidates = [c for c in (match.end() if match else None, by_count) if c is not None]
        return min(candidates) if candidates else None
