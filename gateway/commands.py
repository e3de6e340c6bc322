"""The commands the turn controller (gateway/turn.py) gives its session: what to do, never how."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StartReply:
    """Generate and synthesize a reply to `user_text`; hold its audio until CommitReply."""

    reply_id: int
    user_text: str
    speculative: bool
    turn_end: float | None = None
    """The LLM's P(turn end) of these words (case and punctuation aside), from the prefill of a partial that had
    them: the pause it starts at needs no other score (None: the reply's own prefill scores it)."""
    pause_id: int = 0
    """The ASR pause it answers (its endpoint candidate's): the one its score goes to. 0: none (yet)."""
    score_turn_end: bool = False
    """Ask the LLM to score the words as it starts the reply (no prefill scored them)."""
    on_partial: bool = False
    """Started on a partial, while the user may still be speaking."""
    held_tokens: int | None = None
    """Write at most this many tokens until ConfirmReply; then continue the reply from them (None: no hold)."""


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
    announce: bool = True
    """Tell the client the user's words (user_final); False when the client gave them itself (a typed turn)."""


@dataclass(frozen=True)
class HoldTurn:
    """The user's turn is over with `user_text`, and no reply starts: the client asks for each reply itself."""

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


@dataclass(frozen=True)
class ConfirmReply:
    """A pause has the words of the reply started on a partial: it may write the rest of its words."""

    reply_id: int


@dataclass(frozen=True)
class ScorePause:
    """Tell the ASR the LLM's P(turn end) at pause `pause_id`, which sets the pause's wait (None: none will come)."""

    pause_id: int
    probability: float | None


Command = (
    StartReply
    | Prefill
    | CancelReply
    | CommitReply
    | HoldTurn
    | PausePlayout
    | ResumePlayout
    | Interrupt
    | EndTurn
    | ConfirmReply
    | ScorePause
)
