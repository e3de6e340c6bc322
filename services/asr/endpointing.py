"""Turn detection from per-window VAD probabilities: speech start, endpoint candidate, resume, end of turn."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class EndpointingPolicy:
    """When a pause ends a turn. All durations in milliseconds."""

    vad_threshold: float = 0.5
    """Speech probability above which a window is speech (a window below threshold-0.15 is silence)."""
    candidate_silence_ms: int = 150
    """Silence after speech that makes an endpoint candidate (the final decode and a speculative reply start)."""
    hangover_ms: int = 300
    """Silence after speech that commits the end of the turn."""
    min_speech_ms: int = 96
    """Speech needed to open a turn or to end a pause in one; shorter blips (clicks, breaths) are ignored."""


class Event(enum.Enum):
    SPEECH_STARTED = "speech_started"
    SILENCE_STARTED = "silence_started"  # first silent window after speech: the final decode can start
    ENDPOINT_CANDIDATE = "endpoint_candidate"
    SPEECH_RESUMED = "speech_resumed"
    END_OF_TURN = "end_of_turn"


class Endpointer:
    """Pure state machine: feed one probability per window, get at most one event back.

    Time is counted in audio milliseconds of the stream, so results do not depend on how fast frames arrive.
    """

    def __init__(self, policy: EndpointingPolicy, window_ms: int) -> None:
        self.policy = policy
        self.window_ms = window_ms
        self.in_turn = False
        self.candidate = False
        self._speech_run_ms = 0
        self._silence_ms = 0
        self._blip_ms = 0  # speech windows inside a pause, too short (so far) to end it
        self._speaking = False
        self.now_ms = 0
        self.speech_start_ms = 0
        self.speech_end_ms = 0

    def push(self, probability: float, quiet: bool = False) -> Event | None:
        """Advance one window; returns the event it caused, if any.

        `quiet`: the window's energy is far below the speaker's level. Silero's LSTM keeps saying "speech"
        for 50-200 ms after a voice stops (measured on the test clips); a quiet window ends speech at once.
        """
        self.now_ms += self.window_ms
        threshold = self.policy.vad_threshold
        if quiet:
            is_speech = False
        elif probability >= threshold:
            is_speech = True
        elif probability < max(threshold - 0.15, 0.01):
            is_speech = False
        else:
            is_speech = self._speaking  # hysteresis: keep the current state in the grey zone
        self._speaking = is_speech

        if is_speech:
            self._speech_run_ms += self.window_ms
            if not self.in_turn:
                if self._speech_run_ms >= self.policy.min_speech_ms:
                    self.in_turn = True
                    self._silence_ms = 0
                    self.speech_start_ms = self.now_ms - self._speech_run_ms
                    self.speech_end_ms = self.now_ms
                    return Event.SPEECH_STARTED
                return None
            if self._silence_ms == 0:  # no pause open: the speaker is talking
                self.speech_end_ms = self.now_ms
                return None
            # A pause is open. Only speech of min_speech_ms closes it; a shorter blip (a click, a breath, one
            # window of Silero wavering) stops the pause's clock and, if it dies out, counts as pause.
            if self._speech_run_ms < self.policy.min_speech_ms:
                self._blip_ms += self.window_ms
                return None
            self._silence_ms = self._blip_ms = 0
            self.speech_end_ms = self.now_ms
            if self.candidate:
                self.candidate = False
                return Event.SPEECH_RESUMED
            return None

        return self._silence()

    def _silence(self) -> Event | None:
        self._speech_run_ms = 0
        if not self.in_turn:
            return None
        self._silence_ms += self._blip_ms + self.window_ms
        self._blip_ms = 0
        if self._silence_ms >= self.policy.hangover_ms:
            self.in_turn = False
            self.candidate = False
            self._silence_ms = 0
            return Event.END_OF_TURN
        if not self.candidate and self._silence_ms >= self.policy.candidate_silence_ms:
            self.candidate = True
            return Event.ENDPOINT_CANDIDATE
        if self._silence_ms == self.window_ms and not self.candidate:
            return Event.SILENCE_STARTED
        return None
