"""The LLM engine interface every backend implements (llama.cpp here, vLLM in its own module)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from voicemesh.limits import DEFAULT_MAX_TOKENS


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
    max_tokens: int = DEFAULT_MAX_TOKENS
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
    streaming: bool = True
    prefix_cache: bool = True
    max_concurrency: int = 1


class Engine(Protocol):
    """Text generation. Closing the iterator (or cancelling its task) must stop generation and free the slot."""

    model_name: str
    capabilities: EngineCapabilities

    async def start(self) -> None:
        """Load the model; called once before any generate."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the reply to `request`."""

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""

    async def close(self) -> None:
        """Release the model."""
