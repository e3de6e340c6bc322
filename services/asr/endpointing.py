"""Turn detection from per-window VAD probabilities and a completeness score per pause: speech start and stop,
endpoint candidate, resume, end of turn."""

from __future__ import annotations

import enum

from voicemesh.endpointing import EndpointingPolicy

__all__ = ["TAIL_GAP_MS", "TAIL_MIN_SPEECH_MS", "Endpointer", "EndpointingPolicy", "Event"]

TAIL_GAP_MS = 256
"""Speech that starts this soon after the last speech of a committed turn may be that turn's last sound: the "s" of
"lights" came 128 ms after its vowel, once a language model's score had committed "turn off the kitchen light" in
the 64 ms wait, and lasted 160 ms (issue 40)."""
TAIL_MIN_SPEECH_MS = 256
"""Such speech opens a new turn only once it has lasted this long (else `min_speech_ms`). Opened on the tail, the
turn's decode heard a word ("states"), and the words over a reply none of which was heard continued the committed
turn: the reply was dropped unheard and the user's line got a fragment."""


class Event(enum.Enum):
    SPEECH_STARTED = "speech_started"
    SPEECH_STOPPED = "speech_stopped"  # first silent window of a pause: score it, start the final decode
    ENDPOINT_CANDIDATE = "endpoint_candidate"
    SPEECH_RESUMED = "speech_resumed"  # the pause SPEECH_STOPPED opened is over (its candidate, if any, withdrawn)
    END_OF_TURN = "end_of_turn"


class Endpointer:
    """Pure state machine: feed one probability per window and, when it arrives, the pause's completeness score;
    get the events they cause back.

    Time is counted in audio milliseconds of the stream, so results do not depend on how fast frames arrive. A
    pause commits after `policy.hangover_for(score)` of silence; until its score is in, after the fixed
    hangover, so a scorer that is slow or fails never holds a turn open. Only a decisive score (a language
    model's) may shorten the wait below the fixed hangover; the transcript's ending may only lengthen it, since
    Whisper puts a full stop at many clause ends ("The child almost hurt.").
    """

    def __init__(self, policy: EndpointingPolicy, window_ms: int, awaits_scores: bool = False) -> None:
        self.policy = policy
        self.awaits_scores = awaits_scores and not policy.fixed_hangover  # the client scores every pause
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
        self._committed_end_ms: int | None = None  # the last speech of the turn committed last
        self.pause_id = 0  # counts pauses; a completeness score names the pause it belongs to
        self.completeness: float | None = None  # of the open pause, once scored
        self.decisive = False  # the score is a language model's: it may shorten the wait
        self.awaiting = False  # a language model's score of the open pause is on its way

    @property
    def hangover_ms(self) -> int:
        """The silence that commits the open pause, as far as is known now."""
        scored = self.policy.hangover_for(self.completeness)
        if self.decisive:
            return scored
        return max(scored, self.policy.hangover_ms, self.policy.score_budget_ms if self.awaiting else 0)

    def decline(self, pause_id: int) -> list[Event]:
        """No language model score will come for pause `pause_id`: stop waiting for one (it may commit at once)."""
        if pause_id != self.pause_id or not self.in_turn or self._silence_ms == 0:
            return []
        self.awaiting = False
        return self._maybe_commit()

    def push(self, probability: float, quiet: bool = False) -> list[Event]:
        """Advance one window; returns the events it caused.

        `quiet`: the window's energy is far below the speaker's level. Silero's LSTM keeps saying "speech"
        for a while after a voice stops; a quiet window ends speech at once (docs/decisions/0027).
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
        return self._speech() if is_speech else self._silence()

    def score(self, pause_id: int, completeness: float, decisive: bool = False) -> list[Event]:
        """The completeness score of pause `pause_id` arrived; it may end the turn at once. A decisive score
        replaces any other; one that is not never replaces a decisive one."""
        if pause_id != self.pause_id or not self.in_turn or self._silence_ms == 0:
            return []  # speech resumed or the turn ended meanwhile: the score is stale
        if self.decisive and not decisive:
            return []
        self.completeness, self.decisive = completeness, decisive
        return self._maybe_commit()

    def _speech(self) -> list[Event]:
        self._speech_run_ms += self.window_ms
        if not self.in_turn:
            if self._speech_run_ms >= self._min_speech_to_open():
                self.in_turn = True
                self._silence_ms = 0
                self.speech_start_ms = self.now_ms - self._speech_run_ms
                self.speech_end_ms = self.now_ms
                return [Event.SPEECH_STARTED]
            return []
        if self._silence_ms == 0:  # no pause open: the speaker is talking
            self.speech_end_ms = self.now_ms
            return []
        # A pause is open. Only speech of min_speech_ms closes it; a shorter blip (a click, a breath, one
        # window of Silero wavering) stops the pause's clock and, if it dies out, counts as pause.
        if self._speech_run_ms < self.policy.min_speech_ms:
            self._blip_ms += self.window_ms
            return []
        self._silence_ms = self._blip_ms = 0
        self.completeness, self.decisive, self.awaiting = None, False, False
        self.speech_end_ms = self.now_ms
        self.candidate = False
        return [Event.SPEECH_RESUMED]

    def _min_speech_to_open(self) -> int:
        """The speech that opens a turn now: more right after a committed turn, whose tail it may be."""
        committed, started_ms = self._committed_end_ms, self.now_ms - self._speech_run_ms
        if committed is not None and started_ms - committed < TAIL_GAP_MS:
            return max(self.policy.min_speech_ms, TAIL_MIN_SPEECH_MS)
        return self.policy.min_speech_ms

    def _silence(self) -> list[Event]:
        self._speech_run_ms = 0
        if not self.in_turn:
            return []
        events = []
        if self._silence_ms == 0:
            self.pause_id += 1
            self.completeness, self.decisive, self.awaiting = None, False, self.awaits_scores
            events.append(Event.SPEECH_STOPPED)
        self._silence_ms += self._blip_ms + self.window_ms
        self._blip_ms = 0
        if not self.candidate and self._silence_ms >= self.policy.candidate_silence_ms:
            self.candidate = True
            events.append(Event.ENDPOINT_CANDIDATE)
        return events + self._maybe_commit()

    def _maybe_commit(self) -> list[Event]:
        if self._silence_ms < self.hangover_ms:
            return []
        self.end_turn()
        return [Event.END_OF_TURN]

    def end_turn(self) -> None:
        """The stream committed the turn itself (too long, or the input ended)."""
        if self.in_turn:
            self._committed_end_ms = self.speech_end_ms
        self.in_turn = False
        self.candidate = False
        self._silence_ms = 0
