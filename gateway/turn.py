"""The turn policy of one conversation: a pure, synchronous state machine. Events and the clock in, commands out.

It decides when a reply starts (speculatively at the first silence, or on the committed transcript), when it may
be heard, and what user speech over a reply means:
- a backchannel ("yeah", "mm-hmm"): nothing; the reply goes on;
- a false interruption (a cough, a door, speech that yields no words in time): playout pauses while the
  speech lasts and then resumes where it paused;
- a real interruption (words): the reply stops within a frame and the user's speech becomes the next turn;
- words before any of the reply's words were heard: the turn was committed in a pause inside it, so the user's
  speech continues that turn, and the next reply answers the words before and after the pause together.

When the user's turn ends is decided by the ASR (its hangover follows a completeness score of the pause); this
controller says which pause each of the LLM's scores belongs to, and acts on what the ASR reports.
`gateway/session.py` carries the commands out over gRPC. No I/O, no asyncio: every method that depends on time
takes it in milliseconds of a monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.commands import (
    CancelReply,
    Command,
    CommitReply,
    ConfirmReply,
    EndTurn,
    HoldTurn,
    Interrupt,
    PausePlayout,
    Prefill,
    ResumePlayout,
    ScorePause,
    StartReply,
)
from gateway.words import DEFAULT_BACKCHANNELS, continue_line, is_backchannel
from voicemesh.endpointing import LM_COMPLETE_AT
from voicemesh.evaluation import words_of
from voicemesh.limits import LOOKAHEAD_WORDS

__all__ = [
    "DEFAULT_BACKCHANNELS",
    "CancelReply",
    "Command",
    "CommitReply",
    "ConfirmReply",
    "EndTurn",
    "HoldTurn",
    "Interrupt",
    "PausePlayout",
    "Prefill",
    "ResumePlayout",
    "ScorePause",
    "StartReply",
    "TurnController",
    "TurnPolicy",
    "continue_line",
    "held_reply_tokens",
    "is_backchannel",
    "words_of",
]


@dataclass(frozen=True)
class TurnPolicy:
    """How the controller treats speech; one per session (PipelineOptions fills it)."""

    speculative_start: bool = True
    """Start the reply on the ASR endpoint candidate; it is heard only once the turn commits."""
    prefill_partials: bool = True
    """While the user speaks, load the dialogue with the words of each partial transcript into the LLM's cache."""
    start_on_partials: bool = True
    """With `speculative_start` and `prefill_partials`: start the reply while the user is still speaking, once the
    prefill of the newest partial transcript scores its words a finished turn (P(turn end) at or above
    `start_on_partials_at`). By the time the speech stops and the ASR's draft confirms the same words, the reply's
    first audio is ready, instead of only then starting the LLM and TTS. Like any speculative reply it is heard
    only once the turn commits with the same words; a partial or candidate with other words cancels it."""
    start_on_partials_at: float = LM_COMPLETE_AT
    """The P(turn end) from which a partial starts the reply: the score that also takes the short wait, so the
    turns that commit soonest after the speech stops are those whose reply is ready soonest."""
    barge_in: bool = True
    """User speech over the reply can interrupt it."""
    barge_in_min_speech_ms: int = 500
    """Speech over the reply this long, whose words are not known yet, pauses playout until they are.
    Words decide sooner: a non-backchannel word in any transcript of the speech interrupts at once."""
    resume_false_interruptions: bool = True
    """Pause (and later resume) on wordless speech over the reply; off: such speech interrupts, as before."""
    false_interruption_timeout_ms: int = 1000
    """A pause whose speech yields no words in this long was a false interruption: playout resumes."""
    backchannels: frozenset[str] = DEFAULT_BACKCHANNELS
    """Words and phrases that, alone, acknowledge the reply rather than interrupt it (lower case)."""
    continue_unheard_turns: bool = True
    """Speech that interrupts a reply none of whose words were heard yet continues the user's turn: the commit came
    in a pause inside a sentence. Such speech pauses the reply as it starts, not after `barge_in_min_speech_ms`.
    Off: the words after the pause are a turn of their own, answered without the words before it."""
    scores_pauses: bool = True
    """The LLM scores each pause's words and the ASR waits for the score (off: a fixed hangover, nothing scored)."""
    urgent_words: int = LOOKAHEAD_WORDS.default
    """Words of a reply its listener waits for before the first audio (PipelineOptions.urgent_words)."""
    buffer_whole_reply: bool = False
    """Baseline: the whole reply is written before it is synthesized, so a reply started on a partial is not held."""
    reply_to_turns: bool = True
    """A committed turn starts its reply; off, it is only held (HoldTurn) and the client asks for each reply
    (`on_user_text`), as an OpenAI Realtime client does with turn detection off or create_response false."""


def held_reply_tokens(urgent_words: int) -> int:
    """The tokens a reply started on a partial writes until a pause has its words: about the words its listener
    will wait for (a word is 1-2 tokens; one more completes the TTS's first chunk). The rest would decode on the
    cores the ASR's draft of that pause needs (docs/decisions/0008-start-reply-on-a-partial.md)."""
    return 2 * urgent_words + 2


@dataclass
class _Scoring:
    """Where the score of a live reply (speculative or current) goes, and the score once it is known."""

    pause_id: int  # 0: no pause of the current ASR stream
    score: float | None
    on_partial: bool
    confirmed: bool = False


@dataclass
class _Overlap:
    """User speech while a committed reply is current."""

    started_ms: float
    stopped_ms: float | None = None
    paused_ms: float | None = None
    backchannel: bool = False


@dataclass
class TurnController:
    """One session's turn state. Call the `on_*` methods as things happen and `tick` at `next_tick_ms`."""

    policy: TurnPolicy = field(default_factory=TurnPolicy)
    speculative: tuple[int, str] | None = None  # (reply id, the user's line it answers)
    started_on_partial: bool = False  # the speculative reply started on a partial; no candidate has confirmed it yet
    current: int | None = None  # the committed reply, until it ends
    _current_text: str = ""  # the user's words the current reply answers
    _heard: bool = False  # some of the current reply's words reached the user
    _continues: str = ""  # the words of a turn the user's speech continues (a reply cut before it was heard)
    _overlap: _Overlap | None = None
    _ids: int = 0
    _prefilled: str = ""  # the words of the user's turn in progress last prefilled
    _prefill_score: tuple[tuple[str, ...], float] | None = None  # (words_of a prefill, the LLM's P(turn end) after)
    scorer_available: bool = True  # this session's LLM scores turn ends: learnt from its replies
    _scoring: dict[int, _Scoring] = field(default_factory=dict)  # live replies by id

    # ---- ASR events ----------------------------------------------------------------------------------------
    def on_speech_started(self, now_ms: float) -> list[Command]:
        if self.current is not None and self.policy.barge_in and self._overlap is None:
            self._overlap = _Overlap(started_ms=now_ms)
        return self.tick(now_ms)

    def on_speech_stopped(self, now_ms: float) -> list[Command]:
        if self._overlap is not None and self._overlap.stopped_ms is None:
            self._overlap.stopped_ms = now_ms
        return self.tick(now_ms)

    def on_partial(self, now_ms: float, text: str) -> list[Command]:
        commands = self._overlap_words(now_ms, text) + self.tick(now_ms)
        if self.policy.prefill_partials and self.current is None:
            # Every word, the last too: the LLM's turn-end score after them is what a candidate with the same words
            # would wait for. Where Whisper's guess at the last word changes, the next prefill evaluates it again.
            words = self._whole(" ".join(text.split()))
            if self.started_on_partial and not self._answers(words):
                commands += self._drop_speculative()  # the user went on: its words were not the whole turn
            if self.speculative is None and words != self._prefilled and words_of(words):
                self._prefilled = words
                commands.append(Prefill(words))
        return commands

    def on_prefilled(self, text: str, turn_end: float | None) -> list[Command]:
        """A Prefill of `text` is done, after the same dialogue as now; `turn_end`: the LLM's P(turn end) after its
        words, if it scored them. A candidate with the same words starts its reply with this score; with
        `start_on_partials`, a score that says the turn is finished starts it now, if `text` is still the newest
        partial's words.

        The same words: case and punctuation aside (`words_of`). Whisper's partial and its draft of the same speech
        often differ only there, and the score hardly moves with them (docs/decisions/0100-session-parts.md)."""
        if turn_end is None or self.current is not None:
            return []
        self._prefill_score = (tuple(words_of(text)), turn_end)
        policy = self.policy
        if not (policy.start_on_partials and policy.speculative_start) or self.speculative is not None:
            return []
        if text != self._prefilled or turn_end < policy.start_on_partials_at:
            return []
        self.speculative, self.started_on_partial = (self._next_id(), text), True
        return self._start(self.speculative[0], text, speculative=True, turn_end=turn_end, on_partial=True)

    def on_candidate(self, now_ms: float, text: str, pause_id: int = 0) -> list[Command]:
        """A silence began and `text` is the transcript so far: start a reply to it, unheard for now. `pause_id`
        (the ASR's number for the pause; 0: unnumbered) gets the score of the reply that answers these words."""
        commands = self._overlap_words(now_ms, text)
        if self.current is not None or not self.policy.speculative_start or not words_of(text):
            commands += self.tick(now_ms)
            return self._rescore(pause_id) + commands
        whole = self._whole(text)
        if self.speculative is not None:
            if self._answers(whole):
                self.started_on_partial = False
                return self._rescore(pause_id) + commands  # the reply to an earlier candidate or partial goes on
            commands += self._drop_speculative()
        self.speculative, self.started_on_partial = (self._next_id(), whole), False
        known = self._prefill_score
        turn_end = known[1] if known is not None and known[0] == tuple(words_of(whole)) else None
        return commands + self._start(
            self.speculative[0], whole, speculative=True, turn_end=turn_end, pause_id=pause_id
        )

    def on_speech_resumed(self, now_ms: float) -> list[Command]:
        """The user went on talking after a pause: a speculative reply to it is withdrawn."""
        commands = self._drop_speculative()
        if self._overlap is not None:
            self._overlap.stopped_ms = None
        return commands + self.tick(now_ms)

    def on_final(self, now_ms: float, text: str) -> list[Command]:
        """The ASR committed the user's turn with `text`."""
        self._prefilled, self._prefill_score = "", None  # the next partials are of the next turn
        commands = self._overlap_words(now_ms, text)
        if self.current is not None:
            # Speech over a reply that did not interrupt it (a backchannel, a cough): not a turn. Its pause ends.
            overlap, self._overlap = self._overlap, None
            if overlap is not None and overlap.paused_ms is not None:
                commands.append(
                    ResumePlayout(self.current, "backchannel" if overlap.backchannel else "false_interruption")
                )
            return commands + self._drop_speculative()
        if not words_of(text) and not self._continues:
            return commands + self._drop_speculative()  # noise: no reply
        whole = self._whole(text)
        if not self.policy.reply_to_turns:
            self._continues = ""
            return [*commands, *self._drop_speculative(), HoldTurn(whole)]
        if self.speculative is not None and self._answers(whole):
            reply_id = self.speculative[0]
            self.speculative, self.started_on_partial = None, False
        else:
            commands += self._drop_speculative()
            reply_id = self._next_id()
            commands += self._start(reply_id, whole, speculative=False)
        self.current, self._current_text, self._heard, self._continues = reply_id, whole, False, ""
        commands.append(CommitReply(reply_id, whole))
        return commands

    def on_user_text(self, text: str) -> list[Command]:
        """The client asked for a reply to `text` (typed, or turns it held): a committed turn of its own, refused
        (no commands) while a reply is current."""
        if self.current is not None or not words_of(text):
            return []
        reply_id = self._next_id()
        commands = [*self._drop_speculative(), *self._start(reply_id, text, speculative=False)]
        self.current, self._current_text, self._heard, self._continues = reply_id, text, False, ""
        return [*commands, CommitReply(reply_id, text, announce=False)]

    def on_cancel(self) -> list[Command]:
        """The client cancelled the current reply: it stops as a barge-in would, keeping what was heard."""
        if self.current is None:
            return []
        reply_id, self.current, self._overlap = self.current, None, None
        self._scoring.pop(reply_id, None)
        return [Interrupt(reply_id)]

    def on_asr_restarted(self) -> list[Command]:
        """The ASR stream was replaced (its replica failed) and the new one hears the utterance in progress again:
        a speculative reply to the old stream's candidate is dropped; the new stream's candidate starts another.
        The old stream's pause numbers mean nothing to the new one: no score goes to them any more."""
        for scoring in self._scoring.values():
            scoring.pause_id = 0
        return self._drop_speculative()

    # ---- reply progress ------------------------------------------------------------------------------------
    def on_words_heard(self, reply_id: int) -> None:
        """Words of the committed reply were played to the user (a chunk of its text went out whole)."""
        if reply_id == self.current:
            self._heard = True

    def on_reply_done(self, reply_id: int) -> list[Command]:
        """The committed reply's last frame went out."""
        if reply_id != self.current:
            return []
        self.current, self._overlap = None, None
        self._scoring.pop(reply_id, None)
        return [EndTurn(reply_id)]

    def on_reply_scored(self, reply_id: int, probability: float) -> list[Command]:
        """The reply's LLM scored the turn end of its words: the score goes to the pause the reply answers now."""
        self.scorer_available = True
        scoring = self._scoring.get(reply_id)
        if scoring is None:
            return []
        scoring.score = probability
        return [ScorePause(scoring.pause_id, probability)] if scoring.pause_id else []

    def on_reply_unscored(self, reply_id: int, scorer_missing: bool) -> list[Command]:
        """The reply asked for a score and none will come: its pause stops waiting. `scorer_missing`: the LLM
        answered without one (it cannot score), so this session's pauses are no longer scored by it."""
        if scorer_missing:
            self.scorer_available = False
        scoring = self._scoring.get(reply_id)
        return [ScorePause(scoring.pause_id, None)] if scoring is not None and scoring.pause_id else []

    @property
    def asks_for_scores(self) -> bool:
        """An ASR stream started now is told to wait for the LLM's score of each pause."""
        return self.policy.scores_pauses and self.policy.speculative_start and self.scorer_available

    def on_reply_failed(self, reply_id: int) -> list[Command]:
        """A stage (LLM, TTS) failed mid-reply: the turn ends with what was heard; a speculative one is dropped."""
        if self.speculative is not None and self.speculative[0] == reply_id:
            return self._drop_speculative()
        return self.on_reply_done(reply_id)

    # ---- the clock -----------------------------------------------------------------------------------------
    def tick(self, now_ms: float) -> list[Command]:
        overlap = self._overlap
        if overlap is None or self.current is None or overlap.backchannel:
            return []
        policy = self.policy
        if overlap.paused_ms is None:
            speech_ms = (overlap.stopped_ms if overlap.stopped_ms is not None else now_ms) - overlap.started_ms
            # Over a reply none of whose words were heard, speech most likely goes on with the turn: pause at once.
            unheard = policy.continue_unheard_turns and not self._heard and overlap.stopped_ms is None
            if speech_ms >= policy.barge_in_min_speech_ms or (unheard and policy.resume_false_interruptions):
                if not policy.resume_false_interruptions:
                    return self._interrupt()
                overlap.paused_ms = now_ms
                return [PausePlayout(self.current)]
            if overlap.stopped_ms is not None and now_ms - overlap.stopped_ms >= policy.false_interruption_timeout_ms:
                self._overlap = None  # short and wordless: it never paused anything
            return []
        if now_ms - overlap.paused_ms >= policy.false_interruption_timeout_ms:
            self._overlap = None
            return [ResumePlayout(self.current, "false_interruption")]
        return []

    @property
    def next_tick_ms(self) -> float | None:
        """When `tick` next matters (None: only events can change anything)."""
        overlap = self._overlap
        if overlap is None or self.current is None or overlap.backchannel:
            return None
        timeout = self.policy.false_interruption_timeout_ms
        if overlap.paused_ms is not None:
            return overlap.paused_ms + timeout
        if overlap.stopped_ms is not None:
            return overlap.stopped_ms + timeout
        return overlap.started_ms + self.policy.barge_in_min_speech_ms

    @property
    def waiting_on_words(self) -> bool:
        """User speech over the current reply is being judged: the words of its transcripts decide whether it
        interrupts (the ASR's partials are urgent meanwhile)."""
        return self._overlap is not None and self.current is not None

    @property
    def paused(self) -> bool:
        """The current reply's playout is paused (speech over it whose words are not known yet)."""
        return self._overlap is not None and self._overlap.paused_ms is not None

    # ---- internals -----------------------------------------------------------------------------------------
    def _overlap_words(self, now_ms: float, text: str) -> list[Command]:
        """A transcript of the speech over the reply: words interrupt, acknowledgements let it go on."""
        if self.current is None or not self.policy.barge_in:
            return []
        words = words_of(text)
        if not words:
            return []
        if self._overlap is None:  # words without a speech start seen (a short utterance)
            self._overlap = _Overlap(started_ms=now_ms, stopped_ms=now_ms)
        overlap = self._overlap
        if not is_backchannel(words, self.policy.backchannels):
            return self._interrupt()
        overlap.backchannel = True
        if overlap.paused_ms is not None:
            overlap.paused_ms = None
            return [ResumePlayout(self.current, "backchannel")]
        return []

    def _interrupt(self) -> list[Command]:
        assert self.current is not None
        reply_id = self.current
        continued = self.policy.continue_unheard_turns and not self._heard
        if continued:
            self._continues = self._current_text
        self.current, self._overlap = None, None
        self._scoring.pop(reply_id, None)
        return [Interrupt(reply_id, continued)]

    def _start(
        self,
        reply_id: int,
        text: str,
        speculative: bool,
        turn_end: float | None = None,
        pause_id: int = 0,
        on_partial: bool = False,
    ) -> list[Command]:
        """Start a reply; a score a prefill already gave its words goes to its pause at once."""
        policy = self.policy
        known = turn_end if self.scorer_available else None
        held = held_reply_tokens(policy.urgent_words) if on_partial and not policy.buffer_whole_reply else None
        ask = bool(pause_id) and policy.scores_pauses and known is None
        self._scoring[reply_id] = _Scoring(pause_id, known, on_partial)
        commands: list[Command] = [StartReply(reply_id, text, speculative, known, pause_id, ask, on_partial, held)]
        if known is not None and pause_id:
            commands.append(ScorePause(pause_id, known))
        return commands

    def _rescore(self, pause_id: int) -> list[Command]:
        """A candidate that starts no reply: the speculative reply, if one runs, scores this pause too (its score,
        or the one still coming); otherwise no score will come. The first pause with the words of a reply started
        on a partial confirms them."""
        reply_id = self.speculative[0] if self.speculative is not None else None
        scoring = self._scoring.get(reply_id) if reply_id is not None else None
        commands: list[Command] = []
        if reply_id is not None and scoring is not None and scoring.on_partial and not self.started_on_partial:
            if not scoring.confirmed:
                scoring.confirmed = True
                commands.append(ConfirmReply(reply_id))
        if not pause_id:
            return commands  # an ASR that does not number its pauses takes no scores
        scored = scoring is not None and (scoring.pause_id or scoring.score is not None)
        if scoring is None or not scored or not self.scorer_available:
            return [*commands, ScorePause(pause_id, None)]
        scoring.pause_id = pause_id
        if scoring.score is not None:
            commands.append(ScorePause(pause_id, scoring.score))
        return commands

    def _whole(self, text: str) -> str:
        """The user's turn so far: `text`, after the words of the turn it continues, if any."""
        return continue_line(self._continues, text) if self._continues else text

    def _answers(self, whole: str) -> bool:
        """The speculative reply answers the same words as `whole`, case and punctuation aside: a final and the
        candidate before it differ only there when the final comes from another decode of the same speech."""
        return self.speculative is not None and words_of(self.speculative[1]) == words_of(whole)

    def _drop_speculative(self) -> list[Command]:
        if self.speculative is None:
            return []
        reply_id, self.speculative, self.started_on_partial = self.speculative[0], None, False
        self._scoring.pop(reply_id, None)
        return [CancelReply(reply_id)]

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids
