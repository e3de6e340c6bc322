"""gRPC Synthesizer service: streaming TTS (Piper) with sentence or word chunking, 20 ms frames with text markers."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import numpy as np
from opentelemetry.trace import Span

from services.tts.chunking import Chunker, Policy
from services.tts.engine import Synthesizer, Voice
from services.tts.piper_engine import PiperEngine, check_threads
from voicemesh import config, serving, telemetry
from voicemesh.admission import StreamLimit
from voicemesh.audio import FRAME_MS, Framer, float_to_pcm16, resample
from voicemesh.errors import RequestError, check_session_id, invalid, out_of_range, precondition
from voicemesh.frames import encoding_name
from voicemesh.limits import LOOKAHEAD_WORDS, OUTPUT_RATES
from voicemesh.serving import Draining, OpenCalls, Server, merge_reader, stream_handler
from voicemesh.v1 import audio_pb2, tts_pb2, tts_pb2_grpc
from voicemesh.workers import WorkerPool

# The pool serves chunks earliest deadline first (deadlines in ms on time.monotonic). A reply's first chunk is due
# when its text is ready: its listener is waiting. A later chunk is due before the audio already made for its
# utterance runs out, less REFILL_MS for its own synthesis: so it goes ahead of newer replies' first chunks only
# when its listener would otherwise hear a gap (docs/decisions/0019).
REFILL_MS = 300.0
# Piper starts most sentences with a few tens of ms of near-silence. In a reply's first chunk that is time the
# listener waits for sound that is not there, so it is cut, keeping LEAD_IN_KEPT_MS before the first sample above
# LEAD_IN_LEVEL so the onset itself stays whole (docs/decisions/0013). Later chunks keep theirs: there it is the
# pause between sentences.
LEAD_IN_LEVEL = 10 ** (-60 / 20)
LEAD_IN_KEPT_MS = 5
log = logging.getLogger(__name__)
TRACER = telemetry.tracer(__name__)

MAX_DELTA_BYTES = 4096
MAX_PLAYOUT_AHEAD_MS = 600_000
MAX_UTTERANCE_BYTES = 64 * 1024
MAX_OPEN_UTTERANCES = 16  # begun and not yet flushed or cancelled, per stream (the gateway has one or two)
REMEMBERED_IDS = 1024  # flushed or cancelled utterance ids a stream remembers, to refuse their reuse
POLICIES = {
    tts_pb2.CHUNKING_POLICY_UNSPECIFIED: Policy.WORDS,
    tts_pb2.CHUNKING_POLICY_WORDS: Policy.WORDS,
    tts_pb2.CHUNKING_POLICY_SENTENCE: Policy.SENTENCE,
    tts_pb2.CHUNKING_POLICY_WHOLE: Policy.WHOLE,
}


@dataclasses.dataclass(frozen=True)
class TtsSettings(config.ServerSettings):
    """Settings of the TTS service (flags or VOICEMESH_TTS_* env)."""

    port: int = config.setting(50063, "gRPC port")
    voice_path: str = config.setting(
        "",
        "Piper voice .onnx files (each with its .onnx.json beside it), comma-separated; a stream picks one by file "
        "name, and the first is the default. Empty = en_US-joe-medium",
    )
    intra_op_threads: int = config.setting(
        2, "onnxruntime threads per synthesis (Piper's default would take every core)"
    )
    first_chunk_threads: int = config.setting(
        0,
        "onnxruntime threads for a reply's first chunk, which its listener waits for (a second session of each "
        "voice); 0 = intra_op_threads. A local mesh gives it every core, the LLM stepping aside meanwhile "
        "(VOICEMESH_LLM_FIRST_CHUNK_YIELD_MS; docs/decisions/0014)",
    )
    max_streams: int = config.setting(64, "concurrent streams; more are refused with RESOURCE_EXHAUSTED (0 = no limit)")
    workers: int = config.setting(1, "syntheses run at once; chunks beyond that queue")
    schedule_by_deadline: bool = config.setting(
        True,
        "chunks are synthesized earliest deadline first: a reply's first chunk when its text is ready, a later one "
        "before its reply's audio would run dry; false: first come, first served",
    )
    client_playout: bool = config.setting(
        True,
        "a chunk's deadline comes from the caller's playout (TextDelta.playout_ahead_ms, the audio its listener has "
        "left) when it sends one; false: from the audio made so far, as for a caller that does not",
    )
    trim_lead_in: bool = config.setting(
        True,
        "a reply's first chunk starts at its first sound (-60 dBFS, less 5 ms) instead of the voice's near-silence "
        "before it; false: as the voice made it",
    )


@dataclasses.dataclass
class _Utterance:
    chunker: Chunker
    span: Span | None = None  # tts.synthesize, in the trace of the turn that sent the utterance
    bytes_in: int = 0
    chunks: int = 0
    audio_ms: float = 0.0
    flushed: bool = False
    first_audio_ms: float | None = None  # when its first chunk's audio was ready (time.monotonic, ms)
    playout: tuple[float, float, float] | None = None
    """The caller's latest word on its playout: (when it came, time.monotonic ms; the audio its listener had left,
    ms; `audio_ms` then)."""

    def deadline_ms(self, ready_ns: int) -> float:
        """When the next chunk is needed. From the caller's playout when it sent one: before the audio its listener
        had left, plus what was made since, runs out. Else at once for the first chunk (ready at `ready_ns`), and
        for a later one before the audio made so far runs out (it starts playing about when it is ready)."""
        if self.playout is not None:
            received_ms, ahead_ms, made_ms = self.playout
            return received_ms + ahead_ms + self.audio_ms - made_ms - REFILL_MS
        if self.first_audio_ms is None:
            return ready_ns / 1e6
        return self.first_audio_ms + self.audio_ms - REFILL_MS


def from_first_sound_of(audio: np.ndarray, rate_hz: int) -> np.ndarray:
    """`audio` from LEAD_IN_KEPT_MS before its first sample above LEAD_IN_LEVEL; all of it when none is."""
    loud = np.flatnonzero(np.abs(audio) > LEAD_IN_LEVEL)
    if not loud.size:
        return audio
    return audio[max(0, int(loud[0]) - rate_hz * LEAD_IN_KEPT_MS // 1000) :]


class RecentIds:
    """The last `capacity` ids added: a set whose size stays bounded however long its stream lives."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: collections.OrderedDict[int, None] = collections.OrderedDict()

    def add(self, uid: int) -> None:
        self._ids[uid] = None
        self._ids.move_to_end(uid)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __contains__(self, uid: object) -> bool:
        return uid in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class SynthesisStream:
    """One StreamingSynthesize call: text in, framed audio events out through `events`.

    Drained (`wind_down`), it speaks to their `done` the utterances it has been given text for and starts no other.
    """

    def __init__(
        self,
        cfg: tts_pb2.SynthesisConfig,
        voice: Voice,
        engine: Synthesizer,
        pool: WorkerPool,
        record_text: bool = False,
        by_deadline: bool = True,
        client_playout: bool = True,
        trim_lead_in: bool = True,
    ) -> None:
        self.cfg = cfg
        self.by_deadline = by_deadline  # False: chunks in the order they are ready, across the replica's streams
        self.client_playout = client_playout  # False: TextDelta.playout_ahead_ms is checked but not used
        self.trim_lead_in = trim_lead_in  # a reply's first chunk starts at its first sound
        self.record_text = record_text  # the chunk's text on its span: personal data, off unless asked for
        self.rate_hz = OUTPUT_RATES.check(cfg.sample_rate_hz, "sample_rate_hz")
        self.policy = POLICIES[cfg.chunking]
        self.lookahead = LOOKAHEAD_WORDS.resolve(cfg.lookahead_words, "lookahead_words")
        self.voice = voice
        self._engine = engine
        self._pool = pool
        self.events: asyncio.Queue[tts_pb2.SynthesizeEvent | BaseException | None] = asyncio.Queue()
        self._work: asyncio.Queue[tuple[int, str | None, int]] = asyncio.Queue()  # (utterance, chunk|None=done, t)
        self._utterances: dict[int, _Utterance] = {}
        self._closed_ids = RecentIds(REMEMBERED_IDS)
        self._cancelled = RecentIds(REMEMBERED_IDS)
        self._seq = 0
        self._draining = False
        self._not_started: set[int] = set()  # utterances first seen during the drain: left to another replica
        self._settled = asyncio.Event()  # an utterance was done or cancelled
        self._input_ended = False

    def handle(self, request: tts_pb2.SynthesizeRequest) -> None:
        kind = request.WhichOneof("request")
        if kind == "config" or kind is None:
            raise precondition("a second SynthesisConfig was sent; send it once, as the first message")
        if self._draining and kind in ("text", "flush"):
            uid = request.text.utterance_id if kind == "text" else request.flush.utterance_id
            if self._is_new(uid):
                return
        if kind == "text":
            uid, text = request.text.utterance_id, request.text.text
            if not text:
                raise invalid(f"text of utterance {uid} is empty; send at least one character")
            size = len(text.encode())
            if size > MAX_DELTA_BYTES:
                raise out_of_range(f"text delta is {size} bytes; at most {MAX_DELTA_BYTES} per TextDelta")
            utterance = self._open(uid)
            if utterance.span is None and request.text.traceparent:
                parent = telemetry.context_from({"traceparent": request.text.traceparent})
                utterance.span = TRACER.start_span(
                    "tts.synthesize", context=parent, attributes={"session.id": self.cfg.session_id}
                )
            utterance.bytes_in += size
            if utterance.bytes_in > MAX_UTTERANCE_BYTES:
                raise out_of_range(f"utterance {uid} exceeds {MAX_UTTERANCE_BYTES} bytes of text; flush and start anew")
            if request.text.HasField("playout_ahead_ms"):
                ahead_ms = request.text.playout_ahead_ms
                if ahead_ms > MAX_PLAYOUT_AHEAD_MS:
                    raise out_of_range(
                        f"playout_ahead_ms={ahead_ms} on utterance {uid}; at most {MAX_PLAYOUT_AHEAD_MS} (10 minutes "
                        "of audio)"
                    )
                if self.client_playout:
                    utterance.playout = (time.monotonic_ns() / 1e6, float(ahead_ms), utterance.audio_ms)
            for chunk in utterance.chunker.push(text):
                self._work.put_nowait((uid, chunk, time.monotonic_ns()))
        elif kind == "flush":
            uid = request.flush.utterance_id
            utterance = self._open(uid)
            utterance.flushed = True
            for chunk in utterance.chunker.flush():
                self._work.put_nowait((uid, chunk, time.monotonic_ns()))
            self._work.put_nowait((uid, None, 0))
            self._closed_ids.add(uid)
        elif kind == "cancel":
            uid = request.cancel.utterance_id
            self._cancelled.add(uid)
            self._closed_ids.add(uid)
            cancelled = self._utterances.pop(uid, None)
            if cancelled is not None and cancelled.span is not None:
                cancelled.span.set_attribute("cancelled", True)
                cancelled.span.end()
            self.events.put_nowait(tts_pb2.SynthesizeEvent(cancelled=tts_pb2.UtteranceCancelled(utterance_id=uid)))
            self._settled.set()

    def _is_new(self, uid: int) -> bool:
        """Whether `uid` was not begun before the drain (logged once): its text is left for another replica."""
        if uid in self._utterances or uid in self._closed_ids:
            return False
        if uid not in self._not_started:
            self._not_started.add(uid)
            log.info("utterance not started: draining", extra={"session_id": self.cfg.session_id, "utterance": uid})
        return True

    def _open(self, uid: int) -> _Utterance:
        if uid in self._closed_ids:
            raise precondition(f"utterance {uid} was already flushed or cancelled; use a new utterance_id")
        if uid not in self._utterances:
            if len(self._utterances) >= MAX_OPEN_UTTERANCES:
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{MAX_OPEN_UTTERANCES} utterances are open on this stream; flush or cancel one before utterance "
                    f"{uid}",
                )
            self._utterances[uid] = _Utterance(Chunker(self.policy, self.lookahead))
        return self._utterances[uid]

    async def synthesize_loop(self) -> None:
        """Synthesize queued chunks in order; runs until the end-of-input marker (-1)."""
        while True:
            uid, chunk, ready_ns = await self._work.get()
            if uid < 0:
                return
            if uid in self._cancelled:
                continue
            utterance = self._utterances.get(uid)
            if chunk is None:
                self._utterances.pop(uid, None)
                audio_ms = int(utterance.audio_ms) if utterance else 0
                if utterance is not None and utterance.span is not None:
                    utterance.span.set_attributes({"audio_ms": audio_ms, "chunks": utterance.chunks})
                    utterance.span.end()
                self.events.put_nowait(
                    tts_pb2.SynthesizeEvent(done=tts_pb2.UtteranceDone(utterance_id=uid, audio_ms=audio_ms))
                )
                self._settled.set()
                continue
            submitted_ns = time.monotonic_ns()
            deadline_ms = submitted_ns / 1e6
            if utterance is not None and self.by_deadline:
                deadline_ms = utterance.deadline_ms(ready_ns)
            first = utterance is not None and utterance.chunks == 0
            timed = await self._pool.run(self._render, chunk, first, priority=round(deadline_ms))
            if uid in self._cancelled or utterance is None:
                continue
            # Waiting behind this stream's earlier chunks counts as queueing too, not just the pool's wait.
            queue_ms = (submitted_ns - ready_ns) / 1e6 + timed.queue_ms
            telemetry.QUEUE_WAIT.labels("tts").observe(queue_ms / 1000)
            telemetry.COMPUTE.labels("tts").observe(timed.compute_ms / 1000)
            telemetry.AUDIO.labels("tts").inc(len(timed.result) * FRAME_MS / 1000)
            if utterance.chunks == 0 and utterance.span is not None:
                done_ns = time.time_ns()
                started_ns = done_ns - int(timed.compute_ms * 1e6)
                telemetry.timed_span(TRACER, "tts.queue", started_ns - int(queue_ms * 1e6), started_ns, utterance.span)
                attributes = {"text": chunk} if self.record_text else {"chars": len(chunk)}
                telemetry.timed_span(TRACER, "tts.first_audio", started_ns, done_ns, utterance.span, attributes)
            frames = timed.result
            for index, data in enumerate(frames):
                event = tts_pb2.SynthesizeEvent(
                    audio=tts_pb2.SpeechFrame(
                        utterance_id=uid,
                        frame=audio_pb2.AudioFrame(
                            data=data,
                            encoding=audio_pb2.AUDIO_ENCODING_PCM16LE,
                            sample_rate_hz=self.rate_hz,
                            seq=self._seq,
                        ),
                        text=chunk,
                        chunk_index=utterance.chunks,
                        chunk_end=index == len(frames) - 1,
                    )
                )
                if index == 0:
                    event.audio.timing.queue_ms = queue_ms
                    event.audio.timing.compute_ms = timed.compute_ms
                self._seq += 1
                self.events.put_nowait(event)
            if utterance.first_audio_ms is None:
                utterance.first_audio_ms = time.monotonic_ns() / 1e6
            utterance.chunks += 1
            utterance.audio_ms += len(frames) * FRAME_MS

    def _render(self, text: str, first: bool = False) -> list[bytes]:
        """Synthesize and cut into 20 ms frames at the requested rate (the tail padded with silence). A reply's
        `first` chunk is urgent, and with `trim_lead_in` starts at its first sound."""
        pieces = list(self._engine.synthesize(text, self.voice.name, urgent=first))
        audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
        if first and self.trim_lead_in:
            audio = from_first_sound_of(audio, self.voice.sample_rate_hz)
        audio = resample(audio, self.voice.sample_rate_hz, self.rate_hz)
        framer = Framer(self.rate_hz)
        return [*framer.push(float_to_pcm16(audio)), *framer.flush()]

    def on_loop_done(self, loop: asyncio.Future[None]) -> None:
        """The synthesize loop raised (the engine failed): the call ends with that error instead of going mute."""
        if not loop.cancelled() and (error := loop.exception()) is not None:
            log.error("synthesis failed", extra={"session_id": self.cfg.session_id, "error": repr(error)})
            self.events.put_nowait(error)

    def end_input(self) -> None:
        self._input_ended = True
        self._work.put_nowait((-1, None, 0))

    async def wind_down(self) -> None:
        """Start no new utterance; return once each one given text so far is done (or cancelled)."""
        self._draining = True
        while self._utterances:
            self._settled.clear()
            await self._settled.wait()

    def end(self) -> None:
        """UNAVAILABLE after the events already queued, so the client reconnects elsewhere; unless the client has
        closed its side and every utterance is done: that call is ending by itself, with OK."""
        if self._input_ended and not self._utterances:
            return
        self.events.put_nowait(Draining())

    def is_live(self, event: tts_pb2.SynthesizeEvent) -> bool:
        """Frames of a cancelled utterance still queued are dropped on the way out."""
        return not (event.WhichOneof("event") == "audio" and event.audio.utterance_id in self._cancelled)


def validate_config(cfg: tts_pb2.SynthesisConfig, engine: Synthesizer) -> Voice:
    """The voice the stream speaks in; RequestError naming the field otherwise."""
    check_session_id(cfg.session_id)
    try:
        voice = engine.capabilities.voice(cfg.voice)
    except ValueError as error:
        raise invalid(str(error)) from error
    OUTPUT_RATES.check(cfg.sample_rate_hz, "sample_rate_hz")
    if cfg.encoding != audio_pb2.AUDIO_ENCODING_PCM16LE:
        raise invalid(f"encoding={encoding_name(cfg.encoding)} unsupported; send AUDIO_ENCODING_PCM16LE")
    if cfg.chunking not in POLICIES:
        raise invalid(f"chunking={cfg.chunking} unknown; send CHUNKING_POLICY_SENTENCE, _WORDS or _WHOLE")
    LOOKAHEAD_WORDS.resolve(cfg.lookahead_words, "lookahead_words")
    return voice


class SynthesizerServicer(tts_pb2_grpc.SynthesizerServicer):
    def __init__(self, settings: TtsSettings) -> None:
        self.settings = settings
        self.limit = StreamLimit(settings.max_streams, socket.gethostname())
        self.calls = OpenCalls()
        self.engine: Synthesizer | None = None
        self.pool = WorkerPool(settings.workers, "tts-synth")

    def load(self) -> None:
        paths = [Path(path.strip()) for path in self.settings.voice_path.split(",") if path.strip()]
        engine = PiperEngine(
            paths, intra_op_threads=self.settings.intra_op_threads, urgent_threads=self.settings.first_chunk_threads
        )
        engine.warm_up()
        self.engine = engine
        log.info("voices loaded", extra={"voices": [voice.name for voice in engine.capabilities.voices]})

    @stream_handler
    async def StreamingSynthesize(
        self,
        request_iterator: AsyncIterator[tts_pb2.SynthesizeRequest],
        context: grpc.aio.ServicerContext[tts_pb2.SynthesizeRequest, tts_pb2.SynthesizeEvent],
    ) -> AsyncIterator[tts_pb2.SynthesizeEvent]:
        with self.limit.hold():  # refused before reading anything, so the caller can go elsewhere at once
            async for event in self._stream(request_iterator):
                yield event

    async def _stream(
        self, request_iterator: AsyncIterator[tts_pb2.SynthesizeRequest]
    ) -> AsyncIterator[tts_pb2.SynthesizeEvent]:
        if self.engine is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the voice is still loading; wait for health SERVING")
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("request") != "config":
            raise precondition(f"the first message must be a SynthesisConfig; got {first.WhichOneof('request')}")
        voice = validate_config(first.config, self.engine)
        stream = SynthesisStream(
            first.config,
            voice,
            self.engine,
            self.pool,
            self.settings.log_transcripts,
            self.settings.schedule_by_deadline,
            self.settings.client_playout,
            self.settings.trim_lead_in,
        )
        synthesizer = asyncio.ensure_future(stream.synthesize_loop())
        synthesizer.add_done_callback(stream.on_loop_done)
        log.info("stream opened", extra={"session_id": first.config.session_id, "policy": stream.policy.value})

        async def read() -> None:
            try:
                async for request in request_iterator:
                    stream.handle(request)
            finally:
                stream.end_input()
            await synthesizer
            stream.events.put_nowait(None)

        try:
            with self.calls.hold(stream):
                async for event in merge_reader(read(), stream.events):
                    if stream.is_live(event):
                        yield event
        finally:
            synthesizer.cancel()
            log.info("stream closed", extra={"session_id": first.config.session_id})


def build_server(settings: TtsSettings) -> Server:
    try:
        check_threads(settings.intra_op_threads, settings.first_chunk_threads)
    except ValueError as exc:  # said at start, not as a traceback once the voice loads
        raise SystemExit(f"tts: {exc}") from exc
    servicer = SynthesizerServicer(settings)

    async def load() -> None:
        await asyncio.to_thread(servicer.load)

    return Server(
        settings,
        [tts_pb2.DESCRIPTOR.services_by_name["Synthesizer"].full_name],
        lambda server: tts_pb2_grpc.add_SynthesizerServicer_to_server(servicer, server),
        load,
        drain=servicer.calls.drain,
    )


def main(argv: Sequence[str] | None = None) -> None:
    settings = config.from_argv(TtsSettings, "tts", argv, prog="voicemesh serve tts")
    serving.run("tts", settings, build_server)


if __name__ == "__main__":
    main()
