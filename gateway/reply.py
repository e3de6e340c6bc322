"""One reply: its state (`Reply`), its frames as the playout carries them (`ReplyFrame`), and the run that streams
it from the LLM into the session's TTS stream (`ReplyRun`)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc
from opentelemetry.trace import Span

from voicemesh import telemetry
from voicemesh.clients import epoch_us
from voicemesh.v1 import asr_pb2, audio_pb2, conversation_pb2, llm_pb2, tts_pb2

if TYPE_CHECKING:
    from gateway.backends import Backends
    from gateway.commands import StartReply
    from gateway.links import TtsLink
    from gateway.options import SessionOptions
    from gateway.outbox import Outbox

log = logging.getLogger(__name__)


class TtsDown(Exception):
    """The session's TTS stream is down (being reconnected): a reply cannot be spoken now."""


@dataclass(frozen=True)
class ReplyFrame:
    """One 20 ms frame of the committed reply, as the session hands it to its playout."""

    turn_index: int
    seq: int
    """Its place in the reply, from 0."""
    speech: tts_pb2.SpeechFrame
    """The audio and the text it speaks (`chunk_end`: the last frame of that text)."""

    def event(self, sent_us: int) -> conversation_pb2.ConverseEvent:
        """The frame as the Converse stream carries it, stamped with the time it leaves."""
        frame = audio_pb2.AudioFrame()
        frame.CopyFrom(self.speech.frame)
        frame.seq = self.seq
        frame.capture_time_us = sent_us
        return conversation_pb2.ConverseEvent(
            turn_index=self.turn_index, reply_audio=conversation_pb2.ReplyAudio(frame=frame, text=self.speech.text)
        )


@dataclass
class Reply:
    """One attempt at answering a user turn: speculative until committed."""

    utterance_id: int
    user_text: str
    speculative: bool
    messages: list[llm_pb2.ChatMessage] = field(default_factory=list)  # the dialogue it answers, as it started
    committed: bool = False
    cancelled: bool = False
    llm_task: asyncio.Task[None] | None = None
    text: list[str] = field(default_factory=list)
    frames: collections.deque[tts_pb2.SpeechFrame] = field(default_factory=collections.deque)  # not yet released
    llm_done: bool = False
    tts_started: bool = False
    tts_done: bool = False
    tts_given: str = ""  # the text handed to the TTS so far (sent, or waiting for a TTS stream)
    flush_given: bool = False  # all of it was handed over
    flush_ms: float = 0.0
    synthesized: list[str] = field(default_factory=list)  # chunks whose audio came in whole
    spoken_chunks: list[str] = field(default_factory=list)
    started: str = "pause"  # what started a speculative reply: "pause" (the endpoint candidate) or "partial"
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)  # a pause (or the commit) has its words
    turn_end: float | None = None  # the LLM's P(turn end) for its words, once in
    frames_released: int = 0  # handed to the playout
    frames_sent: int = 0  # played out by the transport
    unconfirmed_chunks: int = 0  # sent whole, the listener's word on hearing them not in yet (Session.confirm_heard)
    # Metrics
    turn_index: int = 0
    usage: llm_pb2.Usage = field(default_factory=llm_pb2.Usage)
    first_frame_received_us: int = 0
    first_sent_us: int = 0
    received_us: int = 0  # the client's report of when its first audio arrived
    metrics: conversation_pb2.TurnMetrics = field(default_factory=conversation_pb2.TurnMetrics)
    timeline: dict[str, int] = field(default_factory=dict)  # milestone -> epoch us, logged at the end of the turn
    span: Span | None = None  # the turn's root span; LLM and TTS spans join its trace
    asr_event: asr_pb2.RecognizeEvent | None = None  # the event whose transcript the reply answers
    committed_us: int = 0
    receipt_us: int = 0

    def mark(self, milestone: str, at_us: int | None = None) -> None:
        self.timeline.setdefault(milestone, at_us or epoch_us())


class ReplySession(Protocol):
    """What a reply's run uses of its session."""

    options: SessionOptions
    backends: Backends
    tts: TtsLink
    outbox: Outbox

    def on_turn_end(self, reply: Reply, probability: float | None, scorer_missing: bool = False) -> None:
        """The LLM's P(turn end) of the reply's words (None: none will come; `scorer_missing`: it cannot score)."""

    def fail(self, reply: Reply) -> None:
        """A stage failed mid-reply: the turn ends without (the rest of) its audio."""


class ReplyRun:
    """Streams one reply's words from the LLM into the session's TTS stream (all at once for `buffer_whole_reply`),
    shows them to the client once the reply is committed, and hands the LLM's turn-end score to the session.

    A reply started on a partial writes only `held_tokens` until a pause has its words (`reply.confirmed`); the
    LLM then continues from what it wrote (`reply_prefix`)."""

    def __init__(self, reply: Reply, start: StartReply, session: ReplySession) -> None:
        self.reply = reply
        self.session = session
        self.score_turn_end = start.score_turn_end
        self.held_tokens = start.held_tokens

    async def run(self) -> None:
        reply, session = self.reply, self.session
        pipeline = session.options.pipeline
        request = llm_pb2.GenerateRequest(
            session_id=session.options.session_id,
            messages=reply.messages,
            max_tokens=pipeline.max_tokens,
            # The LLM says how finished the user's words sound; the ASR waits for the pause accordingly.
            score_turn_end=self.score_turn_end,
            urgent_words=pipeline.urgent_words,
        )
        whole = pipeline.buffer_whole_reply
        if self.held_tokens is not None:
            request.max_tokens = min(request.max_tokens, self.held_tokens)
        stream = self._continued(request, held=self.held_tokens is not None)
        first, scored = True, False
        try:
            async for response in stream:
                if response.HasField("turn_end"):
                    scored = True
                    telemetry.TURN_END_SCORES.labels("reply").inc()
                    session.on_turn_end(reply, response.turn_end.probability)
                    continue
                if first:
                    if request.score_turn_end and not scored:
                        session.on_turn_end(reply, None, scorer_missing=True)  # the pause stops waiting
                    first = False
                    reply.mark("llm_first_delta")
                    reply.metrics.llm_queue_ms = response.queue_ms
                    reply.metrics.llm_first_token_ms = response.ttft_ms
                    reply.metrics.llm_replica = response.replica
                if response.text_delta:
                    reply.text.append(response.text_delta)
                    if len(reply.text) <= 4:
                        reply.mark(f"llm_delta_{len(reply.text)}")
                    if reply.committed:
                        text = conversation_pb2.ReplyText(text_delta=response.text_delta)
                        session.outbox.emit(reply_text=text, turn=reply.turn_index)
                    if not whole:
                        session.tts.text(reply, response.text_delta)
                if response.finish_reason:
                    reply.usage.CopyFrom(response.usage)
            full = "".join(reply.text).strip()
            if whole and full:
                session.tts.text(reply, full)
            session.tts.flush(reply)
            reply.llm_done = True
            reply.mark("llm_done")
        except asyncio.CancelledError:
            await stream.aclose()  # cancels the call: frees the LLM slot at once
            raise
        except grpc.aio.AioRpcError as error:
            await stream.aclose()
            if request.score_turn_end and not scored:
                session.on_turn_end(reply, None)
            session.outbox.report("llm", error)
            session.fail(reply)
        except TtsDown:
            await stream.aclose()  # no voice to speak it with: stop generating now
            session.fail(reply)

    async def _continued(
        self, request: llm_pb2.GenerateRequest, held: bool
    ) -> AsyncGenerator[llm_pb2.GenerateResponse, None]:
        """The reply's stream. A `held` one that its cap cut short goes on, once its words are confirmed, as the
        LLM's continuation of what it wrote; its end then carries the usage of both calls (the first one's prompt,
        their tokens together)."""
        reply, backends = self.reply, self.session.backends
        stream = backends.generate(request, telemetry.metadata_for(reply.span))
        try:
            usage: llm_pb2.Usage | None = None
            async for response in stream:
                if held and response.finish_reason == llm_pb2.FINISH_REASON_LENGTH:
                    usage = response.usage
                    response = llm_pb2.GenerateResponse(text_delta=response.text_delta)  # not the reply's end
                yield response
            if usage is None:
                return
            await reply.confirmed.wait()
            rest = llm_pb2.GenerateRequest()
            rest.CopyFrom(request)
            rest.reply_prefix = "".join(reply.text)
            rest.max_tokens = max(1, self.session.options.pipeline.max_tokens - usage.completion_tokens)
            rest.score_turn_end = False
            await stream.aclose()
            stream = backends.generate(rest, telemetry.metadata_for(reply.span))
            async for response in stream:
                if response.finish_reason:
                    completion = usage.completion_tokens + response.usage.completion_tokens
                    response.usage.CopyFrom(usage)
                    response.usage.completion_tokens = completion
                yield response
        finally:
            await stream.aclose()  # cancels a call still streaming: frees the LLM slot at once
