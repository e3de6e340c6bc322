"""The LLM engine interface every backend implements (llama.cpp here, vLLM in its own module)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from voicemesh.limits import MAX_TOKENS


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user" or "assistant"
    content: str
    # An assistant reply the user spoke over: `content` is only the part that was heard.
    interrupted: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    session_id: str
    messages: list[Message]
    max_tokens: int = MAX_TOKENS.default
    stop: list[str] = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 0.95
    seed: int = 0


@dataclass
class GenerationChunk:
    """One step of a reply stream. Timing fields are set on the first chunk, usage on the last."""

    text: str = ""
    finish_reason: str | None = None  # "stop" or "length" on the last chunk
    queue_ms: float | None = None
    ttft_ms: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class EngineCapabilities:
    max_concurrency: int = 1
    """Requests it generates at once; the server's admission queues the rest by it."""


class Engine(Protocol):
    """Text generation. Closing the iterator (or cancelling its task) must stop generation and free the slot."""

    model_name: str
    capabilities: EngineCapabilities

    async def start(self) -> None:
        """Load the model; called once before any generate."""

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Stream the reply to `request`."""

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""

    async def close(self) -> None:
        """Release the model."""
