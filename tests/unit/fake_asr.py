"""Fakes for the ASR stream's unit tests."""

from __future__ import annotations

import numpy as np


class FakeScriptedVad:
    """Speech and silence by the window, as `script` lists them: (is speech, windows) runs, then silence."""

    def __init__(self, script: list[tuple[bool, int]]) -> None:
        self.windows = 0
        self._states = [speech for speech, count in script for _ in range(count)]

    def probability(self, window: np.ndarray) -> float:
        self.windows += 1
        return 0.9 if self.windows <= len(self._states) and self._states[self.windows - 1] else 0.0
