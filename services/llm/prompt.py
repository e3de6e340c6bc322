"""Prompt formats: how a dialogue becomes model input. Gemma 3 270M is a base model: plain-text completion."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.llm.engine import Message

DEFAULT_PERSONA = (
    "The following is a phone conversation with a friendly, helpful voice assistant. "
    "The assistant answers in one or two short, plain sentences that sound natural when spoken aloud."
)

# A few turns in the target style: they steer a base model far better than instructions do.
FEW_SHOT = (
    ("user", "I just got back from a long walk by the river."),
    ("assistant", "That sounds lovely. Was it busy out there today?"),
    ("user", "What is the capital of France?"),
    ("assistant", "The capital of France is Paris."),
    ("user", "My phone battery keeps dying."),
    ("assistant", "That is annoying. Try lowering the screen brightness and closing apps you are not using."),
)


# An assistant reply the user spoke over, as a narrator's line rather than an `Assistant:` line. The base model
# copies the form of earlier Assistant lines: a heard fragment such as "That is" on one (even with "— (interrupted
# by the user)" after it) came back as the whole of later replies, marker included; as a narrator's line the
# fragment stays in context and was never repeated (measured on Gemma 3 270M, greedy).
INTERRUPTED_NOTE = '(The assistant began to say "{heard}" but the user interrupted.)'


CLOSING = ".,;:!?…-—\"'"
"""Punctuation a transcript may end with: its words end before it. Whisper's full stop is exactly what a turn-end
score is in doubt about."""


def ends_line(piece: str) -> bool:
    """Whether a token's text ends a user's line: it starts (after spaces) with . ? ! or a line break. A turn-end
    score is the probability of such a token right after the user's last word (both engines)."""
    return piece.lstrip(" ")[:1] in (".", "?", "!", "\n")


@dataclass(frozen=True)
class CompletionPrompt:
    """`User:`/`Assistant:` transcript; the reply ends at a newline or at the next speaker label."""

    user_label: str = "User"
    assistant_label: str = "Assistant"
    stop: tuple[str, ...] = field(default=("\n", "User:", "Assistant:"))
    interrupted_note: str = INTERRUPTED_NOTE  # `{heard}`: what was heard of an interrupted reply

    def render(self, messages: list[Message], reply_prefix: str = "") -> str:
        """The text to complete; with `reply_prefix` (a reply a failed replica began), the text continues that.

        Each message renders to the same line whatever follows it, so a session's prompts grow by appending and the
        prefix cache keeps hitting; after an interrupted reply the cache stops a few tokens early, at the turn's
        `Assistant:` cue, which the narrator's line takes the place of."""
        system = [m.content for m in messages if m.role == "system"]
        lines = [(system[0] if system else DEFAULT_PERSONA).strip(), ""]
        for role, content in FEW_SHOT:
            lines.append(f"{self._label(role)}: {content}")
        for message in messages:
            if message.role != "system":
                lines.append(self._line(message))
        prefix = reply_prefix.rstrip()
        lines.append(f"{self.assistant_label}: {prefix}" if prefix else f"{self.assistant_label}:")
        return "\n".join(lines)

    def turn_end_offset(self, text: str) -> int | None:
        """Where the user's words end in `text` (rendered from a dialogue ending with a user message, without a
        reply prefix): before the closing punctuation Whisper adds, which is exactly what is in doubt. None when
        the user's line has no words."""
        cue = f"\n{self.assistant_label}:"
        if not text.endswith(cue):
            return None
        end = len(text) - len(cue)
        line_start = text.rfind("\n", 0, end) + 1 + len(self.user_label) + 2
        while end > line_start and (text[end - 1] in CLOSING or text[end - 1].isspace()):
            end -= 1
        return end if any(ch.isalnum() for ch in text[line_start:end]) else None

    def prefill_text(self, messages: list[Message]) -> str | None:
        """The prompt of a dialogue ending with the user's words so far, cut right after the last word: what a reply
        to any continuation of those words begins with (None: no words)."""
        text = self.render(messages)
        offset = self.turn_end_offset(text)
        return None if offset is None else text[:offset]

    def _line(self, message: Message) -> str:
        content = " ".join(message.content.split())
        if message.role == "assistant" and message.interrupted:
            return self.interrupted_note.format(heard=content)
        return f"{self._label(message.role)}: {content}"

    def _label(self, role: str) -> str:
        return self.user_label if role == "user" else self.assistant_label
