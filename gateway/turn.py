"""The turn policy of one conversation: a pure, synchronous state machine. Events and the clock in, commands out.

It decides when a reply starts (speculatively at the first silence, or on the committed transcript), when it may
be heard, and what user speech over a reply means:
- a backchannel ("yeah", "mm-hmm"): nothing; the reply goes on;
- a false interruption (a cough, a door, speech that yields no words in time): playout pauses while the
  speech lasts and then resumes where it paused;
- a real interruption (words): the reply stops within a frame and the user's speech becomes the next turn;
- words before any of the reply's words were heard: the turn was committed in a pause inside it, so the user's
  speech continues that turn, and the next reply answers the words before and after the pause together.

When the user's turn ends is decided by the ASR (its hangover follows a completeness score of the pause);
this controller acts on what the ASR reports. `gateway/session.py` carries the commands out over gRPC.
No I/O, no asyncio: every method takes the time in milliseconds of a monotonic clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from voicemesh.endpointing import LM_COMPLETE_AT

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
_ANNOTATION = re.compile(r"\[[^\]]*\]|\([^)]*\)|\*[^*]*\*")  # Whisper's "[cough]", "(laughs)": not words
_WORD = re.compile(r"[a-z0-9']+(?:-[a-z0-9']+)*")


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
    in a pause inside it ("He began a confused complaint against the wizard, | who had vanished..."). Such speech
    pauses the reply as it starts, not after `barge_in_min_speech_ms`. Off: the words after the pause are a turn
    of their own, answered without the words before it."""


def held_reply_tokens(urgent_words: int) -> int:
    """The tokens a reply started on a partial writes until a pause has its words: about the words its listener
    will wait for (Gemma writes a word in 1-2 tokens; one more starts the next word, which completes the TTS's first
    chunk). The rest would decode on the cores that pause's draft needs: on 2 cores the draft after spk1_snt1 took
    95 ms instead of 46 while its reply decoded on."""
    return 2 * urgent_words + 2


def words_of(text: str) -> list[str]:
    """The spoken words of a transcript: lower case, no punctuation, no "[cough]"-style annotations."""
    return _WORD.findall(_ANNOTATION.sub(" ", text.lower()))


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


# ---- commands ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StartReply:
    """Generate and synthesize a reply to `user_text`; hold its audio until CommitReply."""

    reply_id: int
    user_text: str
    speculative: bool
    turn_end: float | None = None
    """The LLM's P(turn end) of these words (case and punctuation aside), from the prefill of a partial that had
    them: the pause it starts at needs no other score (None: the reply's own prefill scores it)."""


@dataclass(frozen=True)
class Prefill:
    """Load the dialogue, with `user_text` as the user's words so far, into the LLM's cache: no reply, nobody hears
    anything; the reply at the end of the turn then evaluates only the words after these. The LLM scores the turn
    end after them as it goes (`on_prefilled`)."""

    user_text: str


@dataclass(frozen=True)
class CancelReply:
    """A reply that was never committed: stop its work; it is never heard and never enters the history."""

    reply_id: int


@dataclass(frozen=True)
class CommitReply:
    """The user's turn is over with `user_text`: it enters the history and the reply may be heard."""

    reply_id: int
    user_text: str


@dataclass(frozen=True)
class PausePlayout:
    """Stop sending the reply's audio within a frame but keep it: the speech over it may yet be nothing."""

    reply_id: int


@dataclass(frozen=True)
class ResumePlayout:
    """Send the paused reply's audio on from where it paused (a false interruption or a backchannel)."""

    reply_id: int
    reason: str  # "false_interruption" or "backchannel"


@dataclass(frozen=True)
class Interrupt:
    """The user took the turn: stop the audio within a frame, cancel LLM and TTS; the history keeps what was
    heard, marked as interrupted."""

    reply_id: int
    continued: bool = False
    """None of the reply's words had been heard: the user's speech continues the turn the reply answered, so that
    turn's words leave the history; the next CommitReply carries them with the words that follow."""


@dataclass(frozen=True)
class EndTurn:
    """The reply is over (played to its end, or failed): back to listening."""

    reply_id: int


Command = StartReply | Prefill | CancelReply | CommitReply | PausePlayout | ResumePlayout | Interrupt | EndTurn


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
        often differ only there ("the child" / "The child", "And so, my" / "And so my"): 8 of the 25 candidates that
        missed their prefill's score in bench.turns, each then waiting 50-85 ms for its reply's. The score hardly
        moves with them ("the horizon seems extremely distant" 0.74, "The horizon..." 0.68; the short wait starts
        at 0.45); the closing punctuation is never scored at all."""
        if turn_end is None or self.current is not None:
            return []
        self._prefill_score = (tuple(words_of(text)), turn_end)
        policy = self.policy
        if not (policy.start_on_partials and policy.speculative_start) or self.speculative is not None:
            return []
        if text != self._prefilled or turn_end < policy.start_on_partials_at:
            return []
        self.speculative, self.started_on_partial = (self._next_id(), text), True
        return [StartReply(self.speculative[0], text, speculative=True, turn_end=turn_end)]

    def on_candidate(self, now_ms: float, text: str) -> list[Command]:
        """A silence began and `text` is the transcript so far: start a reply to it, unheard for now."""
        commands = self._overlap_words(now_ms, text)
        if self.current is not None or not self.policy.speculative_start or not words_of(text):
            return commands + self.tick(now_ms)
        whole = self._whole(text)
        if self.speculative is not None:
            if self._answers(whole):
                self.started_on_partial = False
                return commands  # the reply to an earlier candidate (or partial) with these words goes on
            commands.append(CancelReply(self.speculative[0]))
        self.speculative, self.started_on_partial = (self._next_id(), whole), False
        known = self._prefill_score
        turn_end = known[1] if known is not None and known[0] == tuple(words_of(whole)) else None
        commands.append(StartReply(self.speculative[0], whole, speculative=True, turn_end=turn_end))
        return commands

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
        if self.speculative is not None and self._answers(whole):
            reply_id = self.speculative[0]
            self.speculative, self.started_on_partial = None, False
        else:
            commands += self._drop_speculative()
            reply_id = self._next_id()
            commands.append(StartReply(reply_id, whole, speculative=False))
        self.current, self._current_text, self._heard, self._continues = reply_id, whole, False, ""
        commands.append(CommitReply(reply_id, whole))
        return commands

    def on_asr_restarted(self) -> list[Command]:
        """The ASR stream was replaced (its replica failed) and the new one hears the utterance in progress again:
        a speculative reply to the old stream's candidate is dropped; the new stream's candidate starts another."""
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
        return [EndTurn(reply_id)]

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
        return [Interrupt(reply_id, continued)]

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
        return [CancelReply(reply_id)]

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids
