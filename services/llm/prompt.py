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


@dataclass(frozen=True)
class CompletionPrompt:
    """`User:`/`Assistant:` transcript; the reply ends at a newline or at the next speaker label."""

    user_label: str = "User"
    assistant_label: str = "Assistant"
    stop: tuple[str, ...] = field(default=("\n", "User:", "Assistant:"))

    def render(self, messages: list[Message]) -> str:
        """The text to complete. A session's prompts grow by appending, so the prefix cache keeps hitting."""
        system = [m.content for m in messages if m.role == "system"]
        lines = [(system[0] if system else DEFAULT_PERSONA).strip(), ""]
        for role, content in FEW_SHOT:
            lines.append(f"{self._label(role)}: {content}")
        for message in messages:
            if message.role != "system":
                lines.append(f"{self._label(message.role)}: {' '.join(message.content.split())}")
        lines.append(f"{self.assistant_label}:")
        return "\n".join(lines)

    def _label(self, role: str) -> str:
        return self.user_label if role == "user" else self.assistant_label
