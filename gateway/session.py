"""One conversation: the I/O around its TurnController (gateway/turn.py), which decides everything about the turn.

The session feeds the controller the ASR's events, reply progress and the clock, and carries out its commands:
start / cancel / commit a reply (LLM call streaming into the session's TTS stream), pause / resume / stop the
reply's audio, end the turn. The reply's audio goes to the session's playout (gateway/playout.py), which the
transport plays out in real time and which tells the session what was heard. All three backend streams are per
session and long-lived: one ASR stream, one TTS stream, LLM calls on a persistent channel. A backend that fails is
reported as an error event naming the stage and reconnected. Metrics and spans observe the commands.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import Span

from gateway import turn
from gateway.backends import Backends, replica_failed, stalled, watched
from gateway.options import SessionOptions
from gateway.playout import Playout
from voicemesh import stages, telemetry
from voicemesh.clients import epoch_us
from voicemesh.errors import RequestError
from voicemesh.v1 import asr_pb2, audio_pb2, conversation_pb2, llm_pb2, tts_pb2
from voicemesh.workers import Newest

log = logging.getLogger(__name__)
TRACER = telemetry.tracer(__name__)
HOSTNAME = socket.gethostname()

RECONNECT_BACKOFF_S = (0.2, 2.0)
FINISH_TIMEOUT_S = 60.0
ASR_PROGRESS_MS = 200  # the ASR acknowledges the frames it received this often (progress_interval_ms)
# How long a replica may keep a session waiting before it is taken for hung (SIGSTOP, a wedged process) and the work
# moves elsewhere. Short, for a recovery within 2 s; long enough that a busy replica is not mistaken for a hung one.
ASR_STALL_MS = 1000.0  # frames unacknowledged (acknowledgements come every 200 ms of audio, from the event loop)
TTS_STALL_MS = 1500.0  # a reply handed over whole, and no audio (a chunk takes ~100-300 ms; more when queued)
TTS_RESUME_S = 5.0  # the unspoken rest of a reply waits this long for a TTS stream to come back, then fails
RETAIN_MAX_MS = 30_000.0  # the ASR's longest turn (28 s) and its pre-roll: the most audio kept for a replay
RETAIN_PREROLL_MS = 300.0  # audio kept before a turn's speech start (the ASR's own pre-roll is 200 ms)
RETAIN_IDLE_MS = 1000.0  # audio kept between turns
MAX_PENDING_EVENTS = 2000  # events the client has not read yet (~40 s of reply audio on the gRPC door); more: it is
# not reading, and the session ends instead of holding its events in memory
ROLE = {"user": llm_pb2.ROLE_USER, "assistant": llm_pb2.ROLE_ASSISTANT}
RequestT = TypeVar("RequestT")


class TtsDown(Exception):
    """The session's TTS stream is down (being reconnected): a reply cannot be spoken now."""


def trim_history(history: list[HistoryEntry], max_chars: int) -> None:
    """Past `max_chars` of text, drop the oldest turns (in place) down to half of it. Dropping half at once keeps the
    prompt's prefix, and so the LLM's prefix cache, the same for many turns, where dropping one turn at a time would
    change it every turn."""
    if sum(len(entry.text) for entry in history) > max_chars:
        drop_oldest(history, max_chars // 2)


def drop_oldest(history: list[HistoryEntry], keep_chars: int) -> None:
    """Drop the oldest turns (in place) until at most `keep_chars` of text remain, starting again at a user's
    utterance (the latest turn is always kept)."""
    total = sum(len(entry.text) for entry in history)
    drop = 0
    while drop < len(history) - 1 and (total > keep_chars or history[drop].role != "user"):
        total -= len(history[drop].text)
        drop += 1
    del history[:drop]


@dataclass(frozen=True)
class HistoryEntry:
    """One utterance of the dialogue as it was heard."""

    role: str  # "user" or "assistant"
    text: str
    interrupted: bool = False  # an assistant reply the user spoke over: `text` is only what was heard


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
    pause_id: int = 0  # the ASR pause a speculative reply answers (its candidate's); the LLM scores it
    asr_stream: int = 0  # which of the session's ASR streams that pause id belongs to
    turn_end: float | None = None  # the LLM's P(turn end) for it, once in
    frames_released: int = 0  # handed to the playout
    frames_sent: int = 0  # played out by the transport
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


def _now_ms() -> float:
    return time.monotonic_ns() / 1e6


class Session:
    """The pipeline of one conversation, independent of the transport (gRPC Converse, WebSocket, WebRTC).

    The transport calls `push_frame` for each validated input frame and `finish` when the user's side ends,
    forwards `events` (ConverseEvent; a RequestError for a fatal problem; None at the end) and plays `playout`
    (the reply's audio, which is not among the events).
    """

    def __init__(
        self,
        options: SessionOptions,
        backends: Backends,
        history: list[HistoryEntry],
        transport: str = "grpc",
        log_transcripts: bool = False,
        history_max_chars: int = 0,
        history_max_tokens: int = 0,
    ) -> None:
        self.options = options
        self.log_transcripts = log_transcripts  # what was said, in the turn's log line: personal data
        self.history_max_chars = history_max_chars  # 0 = unbounded
        self.history_max_tokens = history_max_tokens  # by the LLM's own count of the last turn; 0 = unbounded
        self.resume_token = ""  # the secret that lets this session's owner resume it (set by the registry)
        self.pipeline = options.pipeline
        self.backends = backends
        self.history = history
        self.events: asyncio.Queue[conversation_pb2.ConverseEvent | RequestError | None] = asyncio.Queue()
        self._overflowed = False
        self.turns = turn.TurnController(options.pipeline.turn_policy())
        self._turn = len([entry for entry in history if entry.role == "user"])
        self._closing = False
        self._audio_ms = 0.0
        self._receipt_us: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._asr_queue: asyncio.Queue[asr_pb2.RecognizeRequest | None] | None = None
        self._asr_seq = 0  # frames sent on the current ASR stream
        self._asr_acked = 0  # frames it acknowledged (RecognizeEvent.frames_received)
        self._asr_acks = False  # it acknowledges frames (an ASR without progress events is never thought hung)
        self._asr_waiting_since: float | None = None  # when frames began to go unacknowledged
        self._asr_base_ms = 0.0  # session audio time of the current ASR stream's start
        self._asr_streams = 0
        self._asr_in_speech = False
        self._asr_scores = False  # the current ASR stream waits for the LLM's TurnScores
        self._asr_decision = False  # the current ASR stream was told a decision waits on its partials
        # The audio an ASR stream may still need, (end in session audio ms, frame): from the pre-roll of the turn in
        # progress (or the last pre-roll between turns) on. A stream that dies or hangs is replaced by one on
        # another replica, which hears this first, so the utterance in progress is not lost. It also holds the
        # first words of the session while the first stream connects.
        self._retained: collections.deque[tuple[float, audio_pb2.AudioFrame]] = collections.deque()
        self._retain_from_ms = 0.0
        self._tts_queue: asyncio.Queue[tts_pb2.SynthesizeRequest | None] | None = None
        self._tts_down_since: float | None = None  # the TTS stream broke off then and is not back yet
        self._tts_heard_ms = 0.0  # the last event of the TTS stream (or its start)
        self._replies: dict[int, Reply] = {}
        # A reply on its way evaluates the prompt in its own call.
        self._prefills = Newest(self._prefill, held=lambda: bool(self._replies) or self._closing)
        self._current: Reply | None = None
        self._discarded = 0
        self._tick_handle: asyncio.TimerHandle | None = None
        self._last_event: asr_pb2.RecognizeEvent | None = None  # the ASR event being handled
        self.playout: Playout[ReplyFrame] = Playout(self._played)
        self._idle = asyncio.Event()
        self._idle.set()
        self._down: set[str] = set()
        self._recent: dict[int, Reply] = {}  # ended turns, for client reports that come after the end
        self.transport = transport
        self._tasks = [
            asyncio.ensure_future(self._supervised("asr", self._asr_loop)),
            asyncio.ensure_future(self._supervised("tts", self._tts_loop)),
        ]

    # ---- input -----------------------------------------------------------------------------------------
    def push_frame(self, frame: audio_pb2.AudioFrame) -> None:
        now_us = epoch_us()
        capture_us = frame.capture_time_us or now_us
        self._receipt_us[capture_us] = now_us
        while len(self._receipt_us) > 500:  # 10 s of frames: far more than an endpoint looks back
            self._receipt_us.popitem(last=False)
        self._audio_ms += self._frame_ms(frame)
        forwarded = audio_pb2.AudioFrame()
        forwarded.CopyFrom(frame)
        forwarded.capture_time_us = capture_us
        self._retained.append((self._audio_ms, forwarded))
        self._trim_retained()
        if self._asr_queue is not None:
            self._forward(forwarded)

    def _frame_ms(self, frame: audio_pb2.AudioFrame) -> float:
        return len(frame.data) / 2 * 1000 / self.options.input_rate_hz

    def _forward(self, frame: audio_pb2.AudioFrame) -> None:
        assert self._asr_queue is not None
        frame.seq = self._asr_seq
        self._asr_seq += 1
        if self._asr_waiting_since is None:
            self._asr_waiting_since = _now_ms()
        self._asr_queue.put_nowait(asr_pb2.RecognizeRequest(frame=frame))

    def _trim_retained(self) -> None:
        oldest_ms = max(self._retain_from_ms, self._audio_ms - RETAIN_MAX_MS)
        while self._retained and self._retained[0][0] <= oldest_ms:
            self._retained.popleft()

    def _retain_from(self, stream_ms: float) -> None:
        """The current ASR stream will not need its audio before `stream_ms` again."""
        self._retain_from_ms = max(self._retain_from_ms, self._asr_base_ms + stream_ms)
        self._trim_retained()

    def _replay(self) -> None:
        """A new ASR stream hears the retained audio first: after a failure, the utterance in progress again."""
        first = self._retained[0] if self._retained else None
        self._asr_base_ms = first[0] - self._frame_ms(first[1]) if first is not None else self._audio_ms
        self._asr_in_speech = False
        if self._asr_streams:
            telemetry.FAILOVERS.labels("asr").inc()
            telemetry.REPLAYED_FRAMES.inc(len(self._retained))
            log.info(
                "replaying the utterance to a new ASR stream",
                extra={"session_id": self.options.session_id, "frames": len(self._retained)},
            )
            self._apply(self.turns.on_asr_restarted())
        self._asr_streams += 1
        for _, frame in self._retained:
            self._forward(frame)

    def _asr_stalled(self) -> str | None:
        if self._asr_acks and self._asr_waiting_since is not None:
            if _now_ms() - self._asr_waiting_since > ASR_STALL_MS:
                return f"the ASR replica acknowledged no audio for {ASR_STALL_MS / 1000:g} s"
        return None

    def _on_ack(self, frames_received: int) -> None:
        if not frames_received:
            return
        self._asr_acks = True
        if frames_received > self._asr_acked:
            self._asr_acked = frames_received
            self._asr_waiting_since = None if frames_received >= self._asr_seq else _now_ms()

    async def finish(self) -> None:
        """The user's side ended: flush the ASR, let the last reply play out, then end the event stream."""
        if self._asr_queue is not None:
            self._asr_queue.put_nowait(None)
        self._closing = True
        try:
            await asyncio.wait_for(self._tasks[0], FINISH_TIMEOUT_S)
            await asyncio.wait_for(self._idle.wait(), FINISH_TIMEOUT_S)
        except TimeoutError:
            log.warning("session did not finish in time", extra={"session_id": self.options.session_id})
        self.events.put_nowait(None)

    async def until_idle(self) -> None:
        """Return once no reply is being generated or spoken (at once if none is)."""
        await self._idle.wait()

    async def close(self) -> None:
        self._closing = True
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        for reply in list(self._replies.values()):
            self._cancel_reply(reply)
        await self._prefills.close()
        self.playout.flush()
        for queue in (self._asr_queue, self._tts_queue):
            if queue is not None:
                queue.put_nowait(None)  # the request iterators end, and with them gRPC's writer tasks
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- ASR ---------------------------------------------------------------------------------------------
    async def _asr_loop(self) -> None:
        """The session's ASR stream, replaced when its replica fails, hangs or drains: the replacement (on another
        replica when there is one) hears the retained audio first, so the utterance in progress is not lost."""
        backoff = RECONNECT_BACKOFF_S[0]
        config = asr_pb2.RecognitionConfig(
            session_id=self.options.session_id,
            sample_rate_hz=self.options.input_rate_hz,
            interim_results=True,
            endpointing=self.pipeline.endpointing,
            decode_window=self.pipeline.asr_decode_window,
            final_after_end_of_turn=not self.pipeline.asr_final_at_silence,
            skip_word_timings=True,  # the gateway needs no word timings; leaving them out saves 100+ ms
            progress_interval_ms=ASR_PROGRESS_MS,
        )
        scored = not self.pipeline.endpointing.fixed_hangover and self.pipeline.speculative_start
        while True:
            # The LLM scores each endpoint candidate as the speculative reply to it starts (when it can).
            config.turn_scores = self._asr_scores = scored and self.backends.llm_scores_turn_end
            queue: asyncio.Queue[asr_pb2.RecognizeRequest | None] = asyncio.Queue()
            target = ""
            try:
                target = self.backends.pick("asr")
                await self.backends.ready(target)
                call = self.backends.recognizer(target).StreamingRecognize(
                    _drain(queue, asr_pb2.RecognizeRequest(config=config)), metadata=self.backends.metadata()
                )
                self._asr_queue, self._asr_seq, self._asr_acked = queue, 0, 0
                self._asr_acks, self._asr_waiting_since, self._asr_decision = False, None, False
                self._replay()
                if self._closing:
                    queue.put_nowait(None)  # the user's side ended while the stream was being replaced
                self._recovered("asr")
                with self.backends.streaming("asr", target):
                    async for event in watched(call, self._asr_stalled):
                        backoff = RECONNECT_BACKOFF_S[0]
                        self._on_asr(event)
                if self._closing:
                    return  # the input ended and the ASR flushed
                raise stalled(grpc.StatusCode.UNAVAILABLE, "the ASR replica ended the stream")
            except grpc.aio.AioRpcError as error:
                self._asr_queue = None
                queue.put_nowait(None)  # ends the request iterator gRPC's writer task still waits on
                if self._fatal_if_bad_request("asr", error) or self._closing:
                    return
                elsewhere = target and len(self.backends.candidates("asr")) > 1
                if elsewhere and replica_failed(error):
                    self.backends.mark_down("asr", target)  # the next pick goes elsewhere
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and elsewhere:
                    continue  # full, not broken: nothing to report
                self._report("asr", error)
                if elsewhere:
                    continue  # another replica takes over at once
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_BACKOFF_S[1])

    def _on_asr(self, event: asr_pb2.RecognizeEvent) -> None:
        """Hand the ASR's event to the turn controller, on the session's clock."""
        now_ms = _now_ms()
        kind = event.WhichOneof("event")
        self._on_ack(event.frames_received)
        if kind == "progress":
            if not self._asr_in_speech:  # between turns only the last second is needed again (the pre-roll of a
                self._retain_from(event.audio_received_ms - RETAIN_IDLE_MS)  # start the VAD has not confirmed)
            return
        self._last_event = event
        controller = self.turns
        if kind == "speech_started":
            self._asr_in_speech = True
            self._retain_from(event.speech_start_ms - RETAIN_PREROLL_MS)
            commands = controller.on_speech_started(now_ms - self._audio_behind_ms(event.speech_start_ms))
        elif kind == "speech_stopped":
            commands = controller.on_speech_stopped(now_ms - self._audio_behind_ms(event.speech_end_ms))
        elif kind == "partial":
            self._emit(
                user_partial=conversation_pb2.Transcript(
                    text=event.partial.text, stable_prefix=event.partial.stable_prefix
                )
            )
            commands = controller.on_partial(now_ms, event.partial.text)
        elif kind == "endpoint_candidate":
            commands = controller.on_candidate(now_ms, event.endpoint_candidate.text.strip())
            if not any(isinstance(c, turn.StartReply) for c in commands):
                self._rescore(event.endpoint_candidate.pause_id)
        elif kind == "speech_resumed":
            commands = controller.on_speech_resumed(now_ms)
        elif kind == "final":
            self._asr_in_speech = False
            self._retain_from(event.speech_end_ms + 50)  # the committed utterance is never replayed
            commands = controller.on_final(now_ms, event.final.text.strip())
        else:
            return
        self._apply(commands)

    def _audio_behind_ms(self, stream_ms: int) -> float:
        """How long ago (in audio received) a point of the ASR stream was: events lag the audio they describe."""
        return max(0.0, self._audio_ms - (self._asr_base_ms + stream_ms))

    # ---- commands -----------------------------------------------------------------------------------------
    def _apply(self, commands: list[turn.Command]) -> None:
        for command in commands:
            match command:
                case turn.StartReply(reply_id, user_text, speculative, turn_end):
                    self._start_reply(reply_id, user_text, speculative, turn_end)
                case turn.Prefill(user_text):
                    self._prefills.offer(user_text)
                case turn.CancelReply(reply_id):
                    reply = self._replies.get(reply_id)
                    if reply is not None:
                        self._discard(reply)
                case turn.CommitReply(reply_id, user_text):
                    reply = self._replies.get(reply_id)
                    if reply is None:  # its stage failed in the meantime: the turn is over before it began
                        self._apply(self.turns.on_reply_failed(reply_id))
                    else:
                        self._commit(reply, user_text)
                case turn.PausePlayout():
                    self.playout.pause()
                    log.info("playout paused: speech over the reply", extra={"session_id": self.options.session_id})
                case turn.ResumePlayout(_, reason):
                    telemetry.OVERLAPS.labels(reason).inc()
                    log.info("playout resumed", extra={"session_id": self.options.session_id, "reason": reason})
                    self.playout.resume()
                    if self._current is not None:
                        self._finish_if_played(self._current)
                case turn.Interrupt(reply_id, continued):
                    if self._current is not None and self._current.utterance_id == reply_id:
                        self._interrupt(self._current, continued)
                case turn.EndTurn(reply_id):
                    if self._current is not None and self._current.utterance_id == reply_id:
                        self._end_turn(self._current)
        self._schedule_tick()
        self._asr_urgency(self.turns.waiting_on_words)

    def _asr_urgency(self, decision: bool) -> None:
        """Tell the ASR when a decision waits on the words of its partials (speech over the reply) and when
        they are captions again; a new stream starts at captions."""
        if self._asr_queue is None or decision == self._asr_decision:
            return
        self._asr_decision = decision
        partials = asr_pb2.PARTIAL_URGENCY_DECISION if decision else asr_pb2.PARTIAL_URGENCY_CAPTIONS
        self._asr_queue.put_nowait(asr_pb2.RecognizeRequest(urgency=asr_pb2.Urgency(partials=partials)))

    def _schedule_tick(self) -> None:
        """The controller's timers (a paused reply resumes when no words come) run on the event loop's clock."""
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        due_ms = self.turns.next_tick_ms
        if due_ms is not None and not self._closing:
            delay_s = max(0.0, due_ms - _now_ms()) / 1000
            self._tick_handle = asyncio.get_running_loop().call_later(delay_s, self._tick)

    def _tick(self) -> None:
        self._tick_handle = None
        self._apply(self.turns.tick(_now_ms()))

    # ---- replies -------------------------------------------------------------------------------------------
    def _start_reply(self, reply_id: int, user_text: str, speculative: bool, turn_end: float | None = None) -> Reply:
        """`turn_end`: the LLM's P(turn end) of these words (case and punctuation aside), known from a prefill: the
        pause gets it now, and the reply does not ask for another."""
        event = self._last_event or asr_pb2.RecognizeEvent()
        reply = Reply(reply_id, user_text, speculative)
        # The dialogue as it is now: a reply started on the final is committed at once, and its user line enters
        # the history before the LLM call is made (it was then in the prompt twice, and the model echoed it).
        reply.messages = self._messages(user_text)
        reply.mark("reply_started")
        reply.asr_event = event
        if speculative and event.WhichOneof("event") == "endpoint_candidate":
            reply.pause_id, reply.asr_stream = event.endpoint_candidate.pause_id, self._asr_streams
        elif speculative:
            reply.started = "partial"
        # A reply started on a partial starts before the speech ends: its span starts now.
        start_us = (event.speech_end_capture_time_us if reply.started == "pause" else 0) or epoch_us()
        reply.span = TRACER.start_span(
            "turn",
            start_time=start_us * 1000,
            attributes={
                "session.id": self.options.session_id,
                "transport": self.transport,
                "replica": HOSTNAME,
                "speculative": speculative,
                "speculative.started": reply.started if speculative else "",
                "audio_s": max(0, event.speech_end_ms - event.speech_start_ms) / 1000,
            },
        )
        self._replies[reply.utterance_id] = reply
        if turn_end is not None and self.backends.llm_scores_turn_end:
            telemetry.TURN_END_SCORES.labels("prefill").inc()
            reply.span.set_attribute("turn_end.from_prefill", True)
            self._turn_score(reply, turn_end)  # to its pause now, or (started on a partial) to the candidate's
        reply.llm_task = asyncio.ensure_future(self._supervised("llm", functools.partial(self._generate, reply)))
        return reply

    async def _prefill(self, user_text: str) -> None:
        request = llm_pb2.PrefillRequest(session_id=self.options.session_id, messages=self._messages(user_text))
        dialogue = (self._turn, len(self.history))
        try:
            response = await self.backends.prefill(request)
            if response is not None and response.HasField("turn_end") and (self._turn, len(self.history)) == dialogue:
                # Of the dialogue as it still is; a score that says the turn is finished may start the reply now.
                self._apply(self.turns.on_prefilled(user_text, response.turn_end.probability))
        except grpc.aio.AioRpcError as error:  # best effort: the reply then evaluates these words itself
            telemetry.PREFILLS.labels("failed").inc()
            log.info(
                "prefill failed",
                extra={"session_id": self.options.session_id, "code": error.code().name, "reason": error.details()},
            )

    def _commit(self, reply: Reply, user_text: str) -> None:
        """The user's turn is final: the reply becomes the current one and may be heard."""
        event = self._last_event or asr_pb2.RecognizeEvent()
        self._emit(user_final=conversation_pb2.Transcript(text=user_text))
        committed_us = epoch_us()
        capture_us = event.speech_end_capture_time_us
        receipt_us = self._receipt_us.get(capture_us, committed_us)
        capture_us = capture_us or receipt_us
        metrics = reply.metrics
        metrics.speech_end_capture_us = capture_us
        metrics.upload_ms = (receipt_us - capture_us) / 1000
        metrics.endpoint_ms = (committed_us - receipt_us) / 1000
        metrics.asr_queue_ms, metrics.asr_compute_ms = event.timing.queue_ms, event.timing.compute_ms
        if event.WhichOneof("event") == "final":
            metrics.hangover_ms, metrics.completeness = event.final.hangover_ms, event.final.completeness
        metrics.turn_end_probability = -1.0 if reply.turn_end is None else reply.turn_end
        reply.committed_us, reply.receipt_us = committed_us, receipt_us
        if reply.speculative:
            telemetry.SPECULATIVE.labels("used", reply.started).inc()
        telemetry.TURNS.inc()
        metrics.speculative_used = reply.speculative
        metrics.started_on_partial = reply.started == "partial"
        metrics.speculative_discarded = self._discarded
        self._discarded = 0
        reply.committed = True
        reply.confirmed.set()
        reply.mark("committed")
        reply.turn_index = self._turn
        self._turn += 1
        self.history.append(HistoryEntry("user", user_text))
        self._current = reply
        self._idle.clear()
        if reply.text:
            self._emit(reply_text=conversation_pb2.ReplyText(text_delta="".join(reply.text)), turn=reply.turn_index)
        self._release(reply)

    def _messages(self, user_text: str) -> list[llm_pb2.ChatMessage]:
        messages = []
        if self.options.system_prompt:
            messages.append(llm_pb2.ChatMessage(role=llm_pb2.ROLE_SYSTEM, content=self.options.system_prompt))
        messages += [
            llm_pb2.ChatMessage(role=ROLE[entry.role], content=entry.text, interrupted=entry.interrupted)
            for entry in self.history
        ]
        messages.append(llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content=user_text))
        return messages

    async def _generate(self, reply: Reply) -> None:
        request = llm_pb2.GenerateRequest(
            session_id=self.options.session_id,
            messages=reply.messages,
            max_tokens=self.pipeline.max_tokens,
            # The LLM says how finished the user's words sound (unless a prefill said it of the same words); the ASR
            # waits for the pause accordingly.
            score_turn_end=bool(reply.pause_id)
            and not self.pipeline.endpointing.fixed_hangover
            and reply.turn_end is None,
            urgent_words=self.pipeline.urgent_words,
        )
        whole = self.pipeline.buffer_whole_reply
        # A reply started on a partial writes only its first words until a pause has its words; the rest is asked
        # for once they are confirmed.
        held = reply.started == "partial" and not whole
        if held:
            request.max_tokens = min(request.max_tokens, turn.held_reply_tokens(request.urgent_words))
        stream = self._continued(reply, request, held)
        first, scored = True, False
        try:
            async for response in stream:
                if response.HasField("turn_end"):
                    self.backends.llm_scores_turn_end = scored = True
                    telemetry.TURN_END_SCORES.labels("reply").inc()
                    self._turn_score(reply, response.turn_end.probability)
                    continue
                if first:
                    if request.score_turn_end and not scored:
                        self._turn_score(reply, None)  # this LLM does not score: the pause stops waiting
                        if self.backends.llm_scores_turn_end:
                            log.info("the LLM does not score turn ends; the ASR stops waiting for its scores")
                            self.backends.llm_scores_turn_end = False
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
                        self._emit(
                            reply_text=conversation_pb2.ReplyText(text_delta=response.text_delta), turn=reply.turn_index
                        )
                    if not whole:
                        self._tts_text(reply, response.text_delta)
                if response.finish_reason:
                    reply.usage.CopyFrom(response.usage)
            full = "".join(reply.text).strip()
            if whole and full:
                self._tts_text(reply, full)
            self._tts_flush(reply)
            reply.llm_done = True
            reply.mark("llm_done")
        except asyncio.CancelledError:
            await stream.aclose()  # cancels the call: frees the LLM slot at once
            raise
        except grpc.aio.AioRpcError as error:
            await stream.aclose()
            if request.score_turn_end and not scored:
                self._turn_score(reply, None)
            self._report("llm", error)
            self._fail(reply)
        except TtsDown:
            await stream.aclose()  # no voice to speak it with: stop generating now
            self._fail(reply)

    async def _continued(
        self, reply: Reply, request: llm_pb2.GenerateRequest, held: bool
    ) -> AsyncGenerator[llm_pb2.GenerateResponse, None]:
        """The reply's stream. A `held` one (started on a partial, its tokens capped) that the cap cut short goes on,
        once its words are confirmed, as the LLM's continuation of what it wrote; its end then carries the usage of
        both calls (the first one's prompt, their tokens together)."""
        stream = self.backends.generate(request, telemetry.metadata_for(reply.span))
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
            rest.max_tokens = max(1, self.pipeline.max_tokens - usage.completion_tokens)
            rest.score_turn_end = False
            await stream.aclose()
            stream = self.backends.generate(rest, telemetry.metadata_for(reply.span))
            async for response in stream:
                if response.finish_reason:
                    completion = usage.completion_tokens + response.usage.completion_tokens
                    response.usage.CopyFrom(usage)
                    response.usage.completion_tokens = completion
                yield response
        finally:
            await stream.aclose()  # cancels a call still streaming: frees the LLM slot at once

    def _rescore(self, pause_id: int) -> None:
        """A candidate that starts no reply: the speculative reply to the same words, if one runs, scores this pause
        too (its score, or the one still coming); otherwise no score will come. A reply started on a partial has
        its prefill's score already, and this is the first pause it answers."""
        speculative = self.turns.speculative
        reply = self._replies.get(speculative[0]) if speculative is not None else None
        if reply is not None and reply.started == "partial" and not self.turns.started_on_partial:
            if not reply.confirmed.is_set():  # the first pause with its words: it may write the rest
                reply.confirmed.set()
                reply.asr_event = self._last_event  # the decode whose words it answers, for the turn's ASR stages
        scored = reply is not None and (reply.pause_id or reply.turn_end is not None)
        if reply is None or not scored or not self.backends.llm_scores_turn_end:
            self._send_turn_score(pause_id, None)
            return
        reply.pause_id, reply.asr_stream = pause_id, self._asr_streams
        if reply.turn_end is not None:
            self._send_turn_score(pause_id, reply.turn_end)

    def _turn_score(self, reply: Reply, probability: float | None) -> None:
        """Hand the LLM's P(turn end) back to the ASR stream whose pause it scores (it sets that pause's wait);
        None: no score will come."""
        if probability is not None:
            reply.mark("turn_scored")
            reply.turn_end = probability
        if reply.pause_id and reply.asr_stream == self._asr_streams and not reply.cancelled:
            self._send_turn_score(reply.pause_id, probability)

    def _send_turn_score(self, pause_id: int, probability: float | None) -> None:
        if self._asr_queue is not None and self._asr_scores:
            score = asr_pb2.TurnScore(pause_id=pause_id, probability=probability or 0.0, declined=probability is None)
            self._asr_queue.put_nowait(asr_pb2.RecognizeRequest(turn_score=score))

    def _tts_text(self, reply: Reply, text: str) -> None:
        reply.tts_given += text
        self._tts_send(tts_pb2.SynthesizeRequest(text=self._delta(reply, text)))

    def _delta(self, reply: Reply, text: str) -> tts_pb2.TextDelta:
        """`text` of `reply` for the TTS: with the turn's trace on the first delta a stream gets, and how urgent the
        next chunk is (the audio the listener has left) once the reply is playing."""
        delta = tts_pb2.TextDelta(utterance_id=reply.utterance_id, text=text)
        if reply is self._current and (ahead_s := self.playout.ahead_s()) is not None:
            delta.playout_ahead_ms = max(0, round(ahead_s * 1000))
        if not reply.tts_started and self._tts_queue is not None:
            reply.tts_started = True
            delta.traceparent = telemetry.traceparent_of(reply.span)
        return delta

    def _tts_flush(self, reply: Reply) -> None:
        reply.flush_given, reply.flush_ms = True, _now_ms()
        self._tts_send(tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=reply.utterance_id)))

    def _tts_send(self, request: tts_pb2.SynthesizeRequest) -> None:
        """Send to the session's TTS stream. While it is being replaced the request waits (the next stream gets
        the reply's unspoken rest), but not past TTS_RESUME_S: then the reply cannot be spoken now."""
        if self._tts_queue is not None:
            self._tts_queue.put_nowait(request)
        elif self._tts_down_since is not None and _now_ms() - self._tts_down_since > TTS_RESUME_S * 1000:
            raise TtsDown

    def _tts_resume(self, reply: Reply) -> None:
        """On a new TTS stream: the text of `reply` the last one did not synthesize whole, and its flush."""
        rest = unsynthesized(reply.tts_given, reply.synthesized)
        if rest.strip():
            self._tts_send(tts_pb2.SynthesizeRequest(text=self._delta(reply, rest)))
        if reply.flush_given:
            self._tts_send(tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=reply.utterance_id)))

    def _tts_lost(self, reply: Reply) -> None:
        """The TTS stream broke off: the audio of the chunk it was in the middle of is taken back (it will be
        synthesized again whole); its frames still held, and those queued for playout but not sent."""
        while reply.frames and not reply.frames[-1].chunk_end:
            reply.frames.pop()
        if reply is self._current:
            turn_index = reply.turn_index
            taken = self.playout.retract(lambda frame: frame.turn_index == turn_index and not frame.speech.chunk_end)
            reply.frames_released -= taken

    def _tts_stalled(self) -> str | None:
        """A reply handed over whole whose audio has not come for TTS_STALL_MS: the replica hung."""
        now = _now_ms()
        for reply in self._replies.values():
            if reply.flush_given and not reply.tts_done and not reply.cancelled:
                if now - max(reply.flush_ms, self._tts_heard_ms) > TTS_STALL_MS:
                    return f"the TTS replica sent no audio for {TTS_STALL_MS / 1000:g} s"
        return None

    def _discard(self, reply: Reply) -> None:
        """A speculative reply was overtaken: never spoken, never in history."""
        self._discarded += 1
        telemetry.SPECULATIVE.labels("discarded", reply.started).inc()
        self._cancel_reply(reply)
        if reply.span is not None:
            reply.span.set_attribute("speculative.discarded", True)
            reply.span.end()

    def _cancel_reply(self, reply: Reply) -> None:
        if reply.cancelled:
            return
        reply.cancelled = True
        telemetry.CANCELLATIONS.inc()
        reply.frames.clear()
        if reply.llm_task is not None and not reply.llm_task.done():
            reply.llm_task.cancel()
        if not reply.tts_done and self._tts_queue is not None:
            self._tts_queue.put_nowait(
                tts_pb2.SynthesizeRequest(cancel=tts_pb2.Cancel(utterance_id=reply.utterance_id))
            )
        self._replies.pop(reply.utterance_id, None)

    def _fail(self, reply: Reply) -> None:
        """A stage failed mid-reply: the turn ends without (the rest of) its audio; the controller decides."""
        self._cancel_reply(reply)
        self._apply(self.turns.on_reply_failed(reply.utterance_id))

    def _interrupt(self, reply: Reply, continued: bool = False) -> None:
        """`continued`: none of the reply was heard and the user's speech continues the turn it answered, whose
        words leave the history (the next commit carries them)."""
        dropped = self._flush_playout(reply)  # first: what was heard ends here
        spoken = " ".join(reply.spoken_chunks)
        self._cancel_reply(reply)
        log.info(
            "barge-in",
            extra={
                "session_id": self.options.session_id,
                "spoken_chars": len(spoken),
                "dropped_frames": dropped,
                "continued": continued,
            },
        )
        telemetry.INTERRUPTIONS.inc()
        if reply.span is not None:
            reply.span.set_attribute("interrupted", True)
            reply.span.set_attribute("turn.continued", continued)
        self._emit(
            interrupted=conversation_pb2.Interrupted(spoken_text=spoken, continued=continued), turn=reply.turn_index
        )
        if continued and not spoken and self.history and self.history[-1].role == "user":
            self.history.pop()  # the turn this one continues: the next commit has its words
        self._end_turn(reply, interrupted=True)

    def _end_turn(self, reply: Reply, interrupted: bool = False) -> None:
        """History gets what was said aloud (marked when cut short); the turn's metrics go out; back to listening.

        Audio of the reply not played yet (a failed stage ends the turn too) is dropped."""
        self._flush_playout(reply)
        self._replies.pop(reply.utterance_id, None)
        text = " ".join(reply.spoken_chunks)
        if text:
            self.history.append(HistoryEntry("assistant", text, interrupted))
        if self.history_max_chars:
            trim_history(self.history, self.history_max_chars)
        tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens  # the next prompt, but for its question
        if self.history_max_tokens and tokens > self.history_max_tokens:
            drop_oldest(self.history, sum(len(entry.text) for entry in self.history) // 2)
        self._emit_metrics(reply)
        if reply.span is not None:
            reply.span.end()
        self._recent[reply.turn_index] = reply
        while len(self._recent) > 4:
            self._recent.pop(min(self._recent))
        self._current = None
        self._idle.set()

    # ---- TTS -----------------------------------------------------------------------------------------------
    async def _tts_loop(self) -> None:
        """The session's TTS stream, replaced when its replica fails, hangs or drains: the replacement (on another
        replica when there is one) synthesizes what the broken stream had not, so replies go on."""
        backoff = RECONNECT_BACKOFF_S[0]
        config = tts_pb2.SynthesisConfig(
            session_id=self.options.session_id,
            voice=self.options.voice,
            sample_rate_hz=self.options.output_rate_hz,
            encoding=audio_pb2.AUDIO_ENCODING_PCM16LE,
            chunking=self.pipeline.tts_chunking,
            lookahead_words=self.pipeline.tts_lookahead_words,
        )
        while True:
            queue: asyncio.Queue[tts_pb2.SynthesizeRequest | None] = asyncio.Queue()
            target = ""
            try:
                target = self.backends.pick("tts")
                await self.backends.ready(target)
                call = self.backends.synthesizer(target).StreamingSynthesize(
                    _drain(queue, tts_pb2.SynthesizeRequest(config=config)), metadata=self.backends.metadata()
                )
                self._tts_queue, self._tts_heard_ms = queue, _now_ms()
                if self._tts_down_since is not None:
                    self._tts_down_since = None
                    for reply in list(self._replies.values()):
                        if not reply.tts_done:
                            telemetry.FAILOVERS.labels("tts").inc()
                            self._tts_resume(reply)
                self._recovered("tts")
                with self.backends.streaming("tts", target):
                    async for event in watched(call, self._tts_stalled):
                        backoff = RECONNECT_BACKOFF_S[0]
                        self._on_tts(event)
                if self._closing:
                    return
                raise stalled(grpc.StatusCode.UNAVAILABLE, "the TTS replica ended the stream")
            except grpc.aio.AioRpcError as error:
                self._tts_queue = None
                queue.put_nowait(None)  # ends the request iterator gRPC's writer task still waits on
                if self._fatal_if_bad_request("tts", error) or self._closing:
                    return
                now = _now_ms()
                if self._tts_down_since is None:
                    self._tts_down_since = now
                    for reply in self._replies.values():
                        self._tts_lost(reply)
                elif now - self._tts_down_since > TTS_RESUME_S * 1000:
                    for reply in list(self._replies.values()):  # no voice for this long: they cannot be spoken now
                        self._fail(reply)
                elsewhere = target and len(self.backends.candidates("tts")) > 1
                if elsewhere and replica_failed(error):
                    self.backends.mark_down("tts", target)
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and elsewhere:
                    continue
                self._report("tts", error)
                if elsewhere:
                    continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_BACKOFF_S[1])

    def _on_tts(self, event: tts_pb2.SynthesizeEvent) -> None:
        self._tts_heard_ms = _now_ms()
        kind = event.WhichOneof("event")
        if kind == "audio":
            reply = self._replies.get(event.audio.utterance_id)
            if reply is None or reply.cancelled:
                return
            if not reply.first_frame_received_us:
                reply.mark("tts_first_frame")
                reply.first_frame_received_us = epoch_us()
                reply.metrics.tts_queue_ms = event.audio.timing.queue_ms
                reply.metrics.tts_first_audio_ms = event.audio.timing.compute_ms
            elif event.audio.chunk_index == 1:
                reply.mark("tts_second_chunk")
            reply.frames.append(event.audio)
            if event.audio.chunk_end:
                reply.synthesized.append(event.audio.text)
            self._release(reply)
        elif kind == "done":
            reply = self._replies.get(event.done.utterance_id)
            if reply is not None:
                reply.tts_done = True
                reply.mark("tts_done")
                self._release(reply)

    # ---- playout -------------------------------------------------------------------------------------------
    def _release(self, reply: Reply) -> None:
        """Hand the committed reply's frames to the playout as they come (all at once for `buffer_whole_reply`)."""
        if reply is not self._current or reply.cancelled:
            return  # speculative: held until it is committed, or dropped
        if self.pipeline.buffer_whole_reply and not reply.tts_done:
            return
        while reply.frames:
            speech = reply.frames.popleft()
            more = speech.chunk_index > 0 and speech.HasField("timing")  # a later chunk's first frame
            self.playout.push(ReplyFrame(reply.turn_index, reply.frames_released, speech), more)
            reply.frames_released += 1
        self._finish_if_played(reply)

    def _flush_playout(self, reply: Reply) -> int:
        """End the reply's playout (dropping what is queued; returns how many frames); the gaps its listener heard
        and how far ahead of it the reply's later audio came go into its metrics."""
        reply.metrics.reply_gap_ms = max(reply.metrics.reply_gap_ms, round(self.playout.gap_s * 1000, 1))
        if self.playout.ahead_min_s is not None:
            ahead_ms = round(self.playout.ahead_min_s * 1000, 1)
            if reply.metrics.HasField("reply_ahead_min_ms"):
                ahead_ms = min(ahead_ms, reply.metrics.reply_ahead_min_ms)
            reply.metrics.reply_ahead_min_ms = ahead_ms
        return self.playout.flush()

    def _played(self, frame: ReplyFrame, sent_us: int) -> None:
        """The transport sent a frame: it was heard, so its text counts as spoken (history, `interrupted`)."""
        reply = self._current
        if reply is None or reply.turn_index != frame.turn_index:
            return  # it was on its way when its reply ended
        if reply.frames_sent == 0:
            reply.mark("first_audio_sent", sent_us)
            reply.first_sent_us = sent_us
        reply.frames_sent += 1
        if frame.speech.chunk_end:
            reply.spoken_chunks.append(frame.speech.text)
            self.turns.on_words_heard(reply.utterance_id)
        self._finish_if_played(reply)

    def _finish_if_played(self, reply: Reply) -> None:
        """The reply is done once all of it was generated, synthesized and played (a paused one waits for its
        resume: the speech over it may yet interrupt it)."""
        if reply is not self._current or reply.cancelled or self.turns.paused:
            return
        if not (reply.llm_done and reply.tts_done) or reply.frames or self.playout.queued:
            return
        self._emit(reply_done=conversation_pb2.ReplyDone(text=" ".join(reply.spoken_chunks)), turn=reply.turn_index)
        self._apply(self.turns.on_reply_done(reply.utterance_id))

    # ---- events ----------------------------------------------------------------------------------------------
    def _emit(self, turn: int | None = None, **event: Any) -> None:
        self.deliver(conversation_pb2.ConverseEvent(turn_index=self._turn if turn is None else turn, **event))

    def deliver(self, event: conversation_pb2.ConverseEvent) -> None:
        """Queue an event for the client. Past MAX_PENDING_EVENTS unread, the client is not reading: its unread
        events are dropped and the session ends with RESOURCE_EXHAUSTED, so memory stays bounded."""
        if self._overflowed:
            return
        if self.events.qsize() >= MAX_PENDING_EVENTS:
            self._overflowed = True
            while not self.events.empty():
                self.events.get_nowait()
            log.warning("client not reading; session ended", extra={"session_id": self.options.session_id})
            telemetry.ERRORS.labels("gateway", "RESOURCE_EXHAUSTED").inc()
            self.events.put_nowait(
                RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the client read none of the last {MAX_PENDING_EVENTS} events (replies, their audio); a "
                    "client must read the event stream as it comes",
                )
            )
            return
        self.events.put_nowait(event)

    def _emit_metrics(self, reply: Reply) -> None:
        metrics = reply.metrics
        metrics.prompt_tokens = reply.usage.prompt_tokens
        metrics.cached_prompt_tokens = reply.usage.cached_prompt_tokens
        metrics.completion_tokens = reply.usage.completion_tokens
        metrics.reply_audio_ms = reply.frames_sent * 20
        if reply.first_sent_us:
            metrics.first_audio_sent_us = reply.first_sent_us
            metrics.v2v_ms = (reply.first_sent_us - metrics.speech_end_capture_us) / 1000
            metrics.gateway_hold_ms = (reply.first_sent_us - reply.first_frame_received_us) / 1000
        self._emit(metrics=metrics, turn=reply.turn_index)
        self._record_turn(reply)
        origin = metrics.speech_end_capture_us
        spoken = (
            {"user_text": reply.user_text, "reply_text": " ".join(reply.spoken_chunks)} if self.log_transcripts else {}
        )
        log.info(
            "turn",
            extra={
                "session_id": self.options.session_id,
                "turn": reply.turn_index,
                "v2v_ms": round(metrics.v2v_ms, 1),
                "reply_gap_ms": metrics.reply_gap_ms,
                "reply_ahead_min_ms": metrics.reply_ahead_min_ms if metrics.HasField("reply_ahead_min_ms") else None,
                "timeline_ms": {k: round((v - origin) / 1000, 1) for k, v in reply.timeline.items()},
                **spoken,
            },
        )

    def _record_turn(self, reply: Reply) -> None:
        """Stage histograms, and the turn's spans for what the gateway measured itself (the ASR stream spans
        many turns, so its decode is recorded here from the times the ASR service reported)."""
        metrics = reply.metrics
        for stage, value_ms in stages.server_stages_ms(metrics).items():
            telemetry.TURN_STAGE.labels(stage).observe(max(0.0, value_ms) / 1000)
        if metrics.v2v_ms:
            telemetry.TURN_V2V.observe(metrics.v2v_ms / 1000)
        span = reply.span
        if span is None:
            return
        span.set_attributes(
            {
                "turn.index": reply.turn_index,
                "v2v_ms": metrics.v2v_ms,
                "llm.replica": metrics.llm_replica,
                "prompt_tokens": metrics.prompt_tokens,
                "completion_tokens": metrics.completion_tokens,
                "speculative.used": metrics.speculative_used,
                "speculative.discarded_before": metrics.speculative_discarded,
            }
        )
        capture_ns, receipt_ns = metrics.speech_end_capture_us * 1000, reply.receipt_us * 1000
        telemetry.timed_span(TRACER, "upload", capture_ns, receipt_ns, span)
        telemetry.timed_span(TRACER, "endpoint", receipt_ns, reply.committed_us * 1000, span)
        event = reply.asr_event
        if event is not None and event.decode_done_us:
            done_ns = event.decode_done_us * 1000
            started_ns = done_ns - int(event.timing.compute_ms * 1e6)
            queued_ns = started_ns - int(event.timing.queue_ms * 1e6)
            attributes = {"service": "asr", "reconstructed": True}
            telemetry.timed_span(TRACER, "asr.queue", max(queued_ns, capture_ns), started_ns, span, attributes)
            telemetry.timed_span(TRACER, "asr.compute", max(started_ns, capture_ns), done_ns, span, attributes)

    def on_client_report(self, report: conversation_pb2.ClientReport) -> None:
        """The client says when a turn's first audio arrived (the downlink stage) and, if it measures them, the hops
        of its own path (`stages.CLIENT_HOPS`). A time out of order with the gateway's own is left out: the client's
        clock is not this one (another machine), or the report is not about this turn."""
        reply = self._current if self._current is not None and self._current.turn_index == report.turn_index else None
        reply = reply or self._recent.get(report.turn_index)
        if reply is None or not reply.first_sent_us:
            return
        received_us = report.first_audio_received_us
        if received_us >= reply.first_sent_us:
            reply.received_us = received_us
            self._hop("downlink", reply, reply.first_sent_us, received_us)
        if report.first_audio_played_us:
            self._hop("playout", reply, reply.received_us or reply.first_sent_us, report.first_audio_played_us)
        capture_us, sent_us = reply.metrics.speech_end_capture_us, report.speech_end_frame_sent_us
        if sent_us and capture_us <= sent_us <= reply.receipt_us:
            self._hop("capture_to_sent", reply, capture_us, sent_us)
            self._hop("sent_to_gateway", reply, sent_us, reply.receipt_us)

    def _hop(self, name: str, reply: Reply, start_us: int, end_us: int) -> None:
        if not start_us or end_us < start_us:
            return
        telemetry.TURN_STAGE.labels(name).observe((end_us - start_us) / 1e6)
        if reply.span is not None:
            telemetry.timed_span(TRACER, stages.span_of(name), start_us * 1000, end_us * 1000, reply.span)

    async def _supervised(self, stage: str, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run one of the session's tasks. One that fails in a way nobody handled ends the session with an error
        naming its stage (an event, a metric and a log line) instead of leaving it deaf or mute. (`work` is made
        here, so a task cancelled before it ran leaves no coroutine never awaited.)"""
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.exception("session task failed", extra={"session_id": self.options.session_id, "stage": stage})
            telemetry.ERRORS.labels(stage, "INTERNAL").inc()
            message = f"the gateway's {stage} stage failed ({type(error).__name__}); start the conversation again"
            self._emit(
                error=conversation_pb2.SessionError(stage=stage, code="INTERNAL", message=message, recoverable=False)
            )
            self.events.put_nowait(RequestError(grpc.StatusCode.INTERNAL, message))

    def _report(self, stage: str, error: grpc.aio.AioRpcError) -> None:
        if stage in self._down and stage != "llm":
            return  # one error event per outage, not one per reconnect attempt
        self._down.add(stage)
        telemetry.ERRORS.labels(stage, error.code().name).inc()
        log.warning(
            "backend failed", extra={"session_id": self.options.session_id, "stage": stage, "code": error.code().name}
        )
        self._emit(
            error=conversation_pb2.SessionError(
                stage=stage, code=error.code().name, message=f"{stage} service: {error.details()}", recoverable=True
            )
        )

    def _recovered(self, stage: str) -> None:
        if stage in self._down:
            self._down.discard(stage)
            log.info("backend back", extra={"session_id": self.options.session_id, "stage": stage})

    def _fatal_if_bad_request(self, stage: str, error: grpc.aio.AioRpcError) -> bool:
        """The backend refused the session's settings (e.g. an unknown voice): retrying cannot help."""
        if error.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return False
        self._emit(
            error=conversation_pb2.SessionError(
                stage=stage, code=error.code().name, message=error.details(), recoverable=False
            )
        )
        self.events.put_nowait(RequestError(error.code(), f"{stage} service refused the session: {error.details()}"))
        return True


def unsynthesized(text: str, chunks: list[str]) -> str:
    """What of `text` comes after `chunks`, the pieces of it synthesized so far (cut from it in order, with the
    whitespace between them trimmed)."""
    done = "".join("".join(chunk.split()) for chunk in chunks)
    index = 0
    for char in done:
        while index < len(text) and text[index].isspace():
            index += 1
        if index == len(text) or text[index] != char:
            break
        index += 1
    return text[index:]


async def _drain(queue: asyncio.Queue[RequestT | None], first: RequestT) -> AsyncIterator[RequestT]:
    """Request iterator of a long-lived stream: `first`, then the queue until None."""
    yield first
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item
