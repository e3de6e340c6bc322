"""A session's long-lived streams to the ASR and the TTS (gateway/streams.py keeps them up): what each sends, what it
keeps for a replay on a new replica, and how its events reach the session."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import AsyncIterable, Callable
from typing import Protocol

from gateway.backends import Backends
from gateway.options import SessionOptions
from gateway.outbox import Outbox
from gateway.reply import Reply, TtsDown
from gateway.streams import ReconnectingStream
from voicemesh import telemetry
from voicemesh.clients import epoch_us
from voicemesh.v1 import asr_pb2, audio_pb2, tts_pb2

log = logging.getLogger(__name__)

ASR_PROGRESS_MS = 200  # the ASR acknowledges the frames it received this often (progress_interval_ms)
# How long a replica may keep a session waiting before it is taken for hung (SIGSTOP, a wedged process) and the work
# moves elsewhere. Short, for a recovery within 2 s; long enough that a busy replica is not mistaken for a hung one.
ASR_STALL_MS = 1000.0  # frames unacknowledged (acknowledgements come every 200 ms of audio, from the event loop)
TTS_STALL_MS = 1500.0  # a reply handed over whole, and no audio (a chunk takes ~100-300 ms; more when queued)
TTS_RESUME_S = 5.0  # the unspoken rest of a reply waits this long for a TTS stream to come back, then fails
RETAIN_MAX_MS = 30_000.0  # the ASR's longest turn (28 s) and its pre-roll: the most audio kept for a replay
RETAIN_PREROLL_MS = 300.0  # audio kept before a turn's speech start (the ASR's own pre-roll is 200 ms)
RETAIN_IDLE_MS = 1000.0  # audio kept between turns


class AsrListener(Protocol):
    """What the ASR stream tells its session, and asks of it."""

    @property
    def closing(self) -> bool:
        """The session is ending: a stream that ends is not replaced."""
        ...

    @property
    def asr_waits_for_scores(self) -> bool:
        """A new stream waits for the LLM's score of each pause."""
        ...

    def on_asr_event(self, event: asr_pb2.RecognizeEvent) -> None:
        """Every event but progress, after the link's own bookkeeping."""

    def on_asr_restarted(self) -> None:
        """A replacement stream hears the utterance in progress again."""


class TtsListener(Protocol):
    """What the TTS stream tells its session, and asks of it."""

    replies: dict[int, Reply]  # the live replies, by utterance id

    @property
    def closing(self) -> bool:
        """The session is ending: a stream that ends is not replaced."""
        ...

    def release(self, reply: Reply) -> None:
        """Audio came for the reply: the playout may take it."""

    def retract(self, reply: Reply) -> None:
        """Take the reply's unfinished chunk back from the playout."""

    def fail(self, reply: Reply) -> None:
        """The reply cannot be spoken now."""

    def ahead_s(self, reply: Reply) -> float | None:
        """The reply's audio its listener has left, once it is playing."""
        ...


def now_ms() -> float:
    return time.monotonic_ns() / 1e6


class AsrLink(ReconnectingStream[asr_pb2.RecognizeRequest, asr_pb2.RecognizeEvent]):
    """The session's ASR stream. It keeps the audio a new stream may need (from the pre-roll of the turn in
    progress, or the last second between turns), so a replacement on another replica hears the utterance in
    progress again; it also holds the first words of the session while the first stream connects. A replica that
    stops acknowledging frames is taken for hung."""

    stage = "asr"

    def __init__(self, options: SessionOptions, backends: Backends, outbox: Outbox, session: AsrListener) -> None:
        super().__init__(backends, outbox, lambda: session.closing)
        self.session = session
        self.input_rate_hz = options.input_rate_hz
        pipeline = options.pipeline
        self.config = asr_pb2.RecognitionConfig(
            session_id=options.session_id,
            sample_rate_hz=options.input_rate_hz,
            interim_results=True,
            endpointing=pipeline.endpointing,
            decode_window=pipeline.asr_decode_window,
            final_after_end_of_turn=not pipeline.asr_final_at_silence,
            skip_word_timings=True,  # the gateway needs no word timings; leaving them out saves 100+ ms
            progress_interval_ms=ASR_PROGRESS_MS,
        )
        self.audio_ms = 0.0  # the session's audio so far
        self.seq = 0  # frames sent on the current stream
        self.acked = 0  # frames it acknowledged (RecognizeEvent.frames_received)
        self.acks = False  # it acknowledges frames (an ASR without progress events is never thought hung)
        self.waiting_since: float | None = None  # when frames began to go unacknowledged
        self.base_ms = 0.0  # session audio time of the current stream's start
        self.streams = 0
        self.in_speech = False
        self.scores = False  # the current stream waits for the LLM's TurnScores
        self.decision = False  # the current stream was told a decision waits on its partials
        # The audio a stream may still need, (end in session audio ms, frame).
        self.retained: collections.deque[tuple[float, audio_pb2.AudioFrame]] = collections.deque()
        self.retain_from_ms = 0.0

    # ---- audio in --------------------------------------------------------------------------------------------
    def push(self, frame: audio_pb2.AudioFrame, capture_us: int) -> None:
        """A frame of the user's audio, captured at `capture_us`: kept for a replay and sent."""
        self.audio_ms += self._frame_ms(frame)
        forwarded = audio_pb2.AudioFrame()
        forwarded.CopyFrom(frame)
        forwarded.capture_time_us = capture_us
        self.retained.append((self.audio_ms, forwarded))
        self._trim_retained()
        if self.queue is not None:
            self._forward(forwarded)

    def behind_ms(self, stream_ms: int) -> float:
        """How long ago (in audio received) a point of the stream was: events lag the audio they describe."""
        return max(0.0, self.audio_ms - (self.base_ms + stream_ms))

    def session_ms(self, event: asr_pb2.RecognizeEvent) -> float:
        """Where in the session's audio a VAD event happened (a resumed speech: now, as far as the stream knows)."""
        kind = event.WhichOneof("event")
        if kind == "speech_started":
            return self.base_ms + event.speech_start_ms
        return self.base_ms + event.speech_end_ms if kind == "speech_stopped" else self.audio_ms

    def _frame_ms(self, frame: audio_pb2.AudioFrame) -> float:
        return len(frame.data) / 2 * 1000 / self.input_rate_hz

    def _forward(self, frame: audio_pb2.AudioFrame) -> None:
        assert self.queue is not None
        frame.seq = self.seq
        self.seq += 1
        if self.waiting_since is None:
            self.waiting_since = now_ms()
        self.queue.put_nowait(asr_pb2.RecognizeRequest(frame=frame))

    def _trim_retained(self) -> None:
        oldest_ms = max(self.retain_from_ms, self.audio_ms - RETAIN_MAX_MS)
        while self.retained and self.retained[0][0] <= oldest_ms:
            self.retained.popleft()

    def _retain_from(self, stream_ms: float) -> None:
        """The current stream will not need its audio before `stream_ms` again."""
        self.retain_from_ms = max(self.retain_from_ms, self.base_ms + stream_ms)
        self._trim_retained()

    # ---- requests --------------------------------------------------------------------------------------------
    def send_score(self, pause_id: int, probability: float | None) -> None:
        """The LLM's P(turn end) at the stream's pause `pause_id` (None: none will come), if the stream waits for it."""
        if self.queue is not None and self.scores:
            score = asr_pb2.TurnScore(pause_id=pause_id, probability=probability or 0.0, declined=probability is None)
            self.queue.put_nowait(asr_pb2.RecognizeRequest(turn_score=score))

    def urgency(self, decision: bool) -> None:
        """Tell the ASR when a decision waits on the words of its partials (speech over the reply) and when they
        are captions again; a new stream starts at captions."""
        if self.queue is None or decision == self.decision:
            return
        self.decision = decision
        partials = asr_pb2.PARTIAL_URGENCY_DECISION if decision else asr_pb2.PARTIAL_URGENCY_CAPTIONS
        self.queue.put_nowait(asr_pb2.RecognizeRequest(urgency=asr_pb2.Urgency(partials=partials)))

    # ---- the stream ------------------------------------------------------------------------------------------
    def _first_request(self) -> asr_pb2.RecognizeRequest:
        """The config; whether the new stream waits for the LLM's pause scores is asked anew each time (the session
        learns whether its LLM scores)."""
        self.config.turn_scores = self.scores = self.session.asr_waits_for_scores
        return asr_pb2.RecognizeRequest(config=self.config)

    def _method(self, target: str) -> Callable[..., AsyncIterable[asr_pb2.RecognizeEvent]]:
        return self.backends.recognizer(target).StreamingRecognize

    def _connected(self) -> None:
        """A new stream hears the retained audio first: after a failure, the utterance in progress again."""
        self.seq, self.acked = 0, 0
        self.acks, self.waiting_since, self.decision = False, None, False
        first = self.retained[0] if self.retained else None
        self.base_ms = first[0] - self._frame_ms(first[1]) if first is not None else self.audio_ms
        self.in_speech = False
        if self.streams:
            telemetry.FAILOVERS.labels("asr").inc()
            telemetry.REPLAYED_FRAMES.inc(len(self.retained))
            log.info(
                "replaying the utterance to a new ASR stream",
                extra={"session_id": self.config.session_id, "frames": len(self.retained)},
            )
            self.session.on_asr_restarted()
        self.streams += 1
        for _, frame in self.retained:
            self._forward(frame)
        if self._closing() and self.queue is not None:
            self.queue.put_nowait(None)  # the user's side ended while the stream was being replaced

    def _stalled(self) -> str | None:
        if self.acks and self.waiting_since is not None:
            if now_ms() - self.waiting_since > ASR_STALL_MS:
                return f"the ASR replica acknowledged no audio for {ASR_STALL_MS / 1000:g} s"
        return None

    def _on_event(self, event: asr_pb2.RecognizeEvent) -> None:
        kind = event.WhichOneof("event")
        self._on_ack(event.frames_received)
        if kind == "progress":
            if not self.in_speech:  # between turns only the last second is needed again (the pre-roll of a
                self._retain_from(event.audio_received_ms - RETAIN_IDLE_MS)  # start the VAD has not confirmed)
            return
        if kind == "speech_started":
            self.in_speech = True
            self._retain_from(event.speech_start_ms - RETAIN_PREROLL_MS)
        elif kind == "final":
            self.in_speech = False
            self._retain_from(event.speech_end_ms + 50)  # the committed utterance is never replayed
        self.session.on_asr_event(event)

    def _on_ack(self, frames_received: int) -> None:
        if not frames_received:
            return
        self.acks = True
        if frames_received > self.acked:
            self.acked = frames_received
            self.waiting_since = None if frames_received >= self.seq else now_ms()


class TtsLink(ReconnectingStream[tts_pb2.SynthesizeRequest, tts_pb2.SynthesizeEvent]):
    """The session's TTS stream: every reply's text goes out on it and its audio comes back into the reply. When the
    stream breaks, each reply's unfinished chunk is taken back and a new stream synthesizes what the broken one had
    not; a reply that cannot be spoken for TTS_RESUME_S fails."""

    stage = "tts"

    def __init__(self, options: SessionOptions, backends: Backends, outbox: Outbox, session: TtsListener) -> None:
        super().__init__(backends, outbox, lambda: session.closing)
        pipeline = options.pipeline
        self.config = tts_pb2.SynthesisConfig(
            session_id=options.session_id,
            voice=options.voice,
            sample_rate_hz=options.output_rate_hz,
            encoding=audio_pb2.AUDIO_ENCODING_PCM16LE,
            chunking=pipeline.tts_chunking,
            lookahead_words=pipeline.tts_lookahead_words,
        )
        self.session = session
        self.replies = session.replies  # the session's live replies, by utterance id
        self.down_since: float | None = None  # the stream broke off then and is not back yet
        self.heard_ms = 0.0  # the last event of the stream (or its start)

    # ---- requests --------------------------------------------------------------------------------------------
    def text(self, reply: Reply, text: str) -> None:
        reply.tts_given += text
        self._send(tts_pb2.SynthesizeRequest(text=self.delta(reply, text)))

    def flush(self, reply: Reply) -> None:
        reply.flush_given, reply.flush_ms = True, now_ms()
        self._send(tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=reply.utterance_id)))

    def cancel(self, reply: Reply) -> None:
        if not reply.tts_done and self.queue is not None:
            self.queue.put_nowait(tts_pb2.SynthesizeRequest(cancel=tts_pb2.Cancel(utterance_id=reply.utterance_id)))

    def delta(self, reply: Reply, text: str) -> tts_pb2.TextDelta:
        """`text` of `reply` for the TTS: with the turn's trace on the first delta a stream gets, and how urgent the
        next chunk is (the audio the listener has left) once the reply is playing."""
        delta = tts_pb2.TextDelta(utterance_id=reply.utterance_id, text=text)
        if (ahead_s := self.session.ahead_s(reply)) is not None:
            delta.playout_ahead_ms = max(0, round(ahead_s * 1000))
        if not reply.tts_started and self.queue is not None:
            reply.tts_started = True
            delta.traceparent = telemetry.traceparent_of(reply.span)
        return delta

    def _send(self, request: tts_pb2.SynthesizeRequest) -> None:
        """Send on the stream. While it is being replaced the request waits (the next stream gets the reply's
        unspoken rest), but not past TTS_RESUME_S: then the reply cannot be spoken now."""
        if self.queue is not None:
            self.queue.put_nowait(request)
        elif self.down_since is not None and now_ms() - self.down_since > TTS_RESUME_S * 1000:
            raise TtsDown

    # ---- the stream ------------------------------------------------------------------------------------------
    def _first_request(self) -> tts_pb2.SynthesizeRequest:
        return tts_pb2.SynthesizeRequest(config=self.config)

    def _method(self, target: str) -> Callable[..., AsyncIterable[tts_pb2.SynthesizeEvent]]:
        return self.backends.synthesizer(target).StreamingSynthesize

    def _connected(self) -> None:
        self.heard_ms = now_ms()
        if self.down_since is not None:
            self.down_since = None
            for reply in list(self.replies.values()):
                if not reply.tts_done:
                    telemetry.FAILOVERS.labels("tts").inc()
                    self._resume(reply)

    def _resume(self, reply: Reply) -> None:
        """On a new stream: the text of `reply` the last one did not synthesize whole, and its flush."""
        rest = unsynthesized(reply.tts_given, reply.synthesized)
        if rest.strip():
            self._send(tts_pb2.SynthesizeRequest(text=self.delta(reply, rest)))
        if reply.flush_given:
            self._send(tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=reply.utterance_id)))

    def _broken(self) -> None:
        now = now_ms()
        if self.down_since is None:
            self.down_since = now
            for reply in self.replies.values():
                self._lost(reply)
        elif now - self.down_since > TTS_RESUME_S * 1000:
            for reply in list(self.replies.values()):  # no voice for this long: they cannot be spoken now
                self.session.fail(reply)

    def _lost(self, reply: Reply) -> None:
        """The audio of the chunk the broken stream was in the middle of is taken back (it will be synthesized
        again whole): its frames still held, and those queued for playout but not sent."""
        while reply.frames and not reply.frames[-1].chunk_end:
            reply.frames.pop()
        self.session.retract(reply)

    def _stalled(self) -> str | None:
        """A reply handed over whole whose audio has not come for TTS_STALL_MS: the replica hung."""
        now = now_ms()
        for reply in self.replies.values():
            if reply.flush_given and not reply.tts_done and not reply.cancelled:
                if now - max(reply.flush_ms, self.heard_ms) > TTS_STALL_MS:
                    return f"the TTS replica sent no audio for {TTS_STALL_MS / 1000:g} s"
        return None

    def _on_event(self, event: tts_pb2.SynthesizeEvent) -> None:
        self.heard_ms = now_ms()
        kind = event.WhichOneof("event")
        if kind == "audio":
            reply = self.replies.get(event.audio.utterance_id)
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
            self.session.release(reply)
        elif kind == "done":
            reply = self.replies.get(event.done.utterance_id)
            if reply is not None:
                reply.tts_done = True
                reply.mark("tts_done")
                self.session.release(reply)


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
