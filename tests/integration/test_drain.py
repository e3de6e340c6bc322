"""Graceful drain (a rolling update's SIGTERM): each service finishes the work in flight and then sends its streams to
another replica with UNAVAILABLE, refusing new calls meanwhile; the gateway's WebSocket door lets the reply being
spoken play to its end before it closes the page's socket."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import tempfile
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.llm import server as llm_server
from services.llm.engine import EngineCapabilities, GenerationChunk, GenerationRequest
from tests.conftest import TRANSCRIPTS, load_clip, max_wer
from tests.integration.helpers import expect_error, requests, start_gateway
from tests.integration.test_web import open_ws
from voicemesh.audio import Clip
from voicemesh.clients import paced, pcm_frame
from voicemesh.config import ServerSettings
from voicemesh.evaluation import word_error_rate
from voicemesh.mesh import Mesh, Process, free_port
from voicemesh.serving import END_GRACE_S, Draining, OpenCalls, Server, merge_reader, stream_handler
from voicemesh.v1 import asr_pb2, asr_pb2_grpc, audio_pb2, llm_pb2, llm_pb2_grpc, tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.integration

REFUSED = "draining; use another replica"
ENDED = "server draining; reconnect to another replica"


@contextlib.asynccontextmanager
async def service(kind: str) -> AsyncIterator[Process]:
    """A service process of its own (the test stops it), SERVING; stopped at the end if it still runs."""
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix="voicemesh-test-logs-"))
    process = mesh.start(kind, free_port(), ["--drain-grace-s", "20"])
    try:
        await mesh.wait(timeout_s=120)
        yield process
    finally:
        await asyncio.to_thread(mesh.stop_all)


async def not_serving(target: str) -> None:
    """Return once the server's health says NOT_SERVING (from then on it refuses new calls)."""
    async with grpc.aio.insecure_channel(target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        async for reply in watch:
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                watch.cancel()  # an open watch would hold the server's stop until the grace is over
                return


async def exit_code(process: Process) -> int:
    return await asyncio.to_thread(process.popen.wait, 30)


# ---- ASR -------------------------------------------------------------------------------------------------------
def recognition_config(session_id: str) -> asr_pb2.RecognitionConfig:
    return asr_pb2.RecognitionConfig(session_id=session_id, sample_rate_hz=16000, interim_results=True)


async def microphone(config: asr_pb2.RecognitionConfig, clip: Clip | None) -> AsyncIterator[asr_pb2.RecognizeRequest]:
    """The config, the clip at real-time pace, 3 s of silence at once, then nothing, never closing (as the gateway's
    stream). Quiet at the end because a client still writing when the server ends the call may see INTERNAL "Internal
    error from Core" instead of the server's status (grpc/grpc#36066): measured, 3-4% of calls ended under a writer
    paced at 20 ms."""
    yield asr_pb2.RecognizeRequest(config=config)
    seq = itertools.count()
    speech = clip.to_rate(16000).frames() if clip is not None else []
    async for _, data in paced(speech):
        yield asr_pb2.RecognizeRequest(frame=pcm_frame(data, 16000, next(seq)))
    for _ in range(150):
        yield asr_pb2.RecognizeRequest(frame=pcm_frame(b"\x00\x00" * 320, 16000, next(seq)))
    await asyncio.Event().wait()  # until the call ends


async def until_ended(call: AsyncIterator[object], events: list[object]) -> tuple[grpc.aio.AioRpcError, float]:
    """Collect a call's events into `events` until it fails; the failure and when it came (the loop's clock)."""
    try:
        async for event in call:
            events.append(event)
    except grpc.aio.AioRpcError as error:
        return error, asyncio.get_running_loop().time()
    raise AssertionError("the call ended with OK")


async def test_asr_finishes_the_utterance_in_flight_then_sends_the_stream_elsewhere() -> None:
    """SIGTERM mid-utterance: its final still comes, then UNAVAILABLE; a stream between turns ends at once; a new
    stream is refused while the drain goes on; the process exits cleanly."""
    async with service("asr") as asr, grpc.aio.insecure_channel(asr.target) as channel:
        stub = asr_pb2_grpc.RecognizerStub(channel)
        quiet: list[object] = []
        idle = asyncio.ensure_future(
            until_ended(stub.StreamingRecognize(microphone(recognition_config("idle"), None)), quiet)
        )
        events: list[asr_pb2.RecognizeEvent] = []
        at_sigterm: asr_pb2.RecognizeEvent | None = None
        refusal = ""

        async def speak() -> tuple[grpc.aio.AioRpcError, float]:
            nonlocal at_sigterm, refusal
            call = stub.StreamingRecognize(microphone(recognition_config("busy"), load_clip("spk1_snt1")))
            try:
                async for event in call:
                    events.append(event)
                    if event.WhichOneof("event") == "partial" and at_sigterm is None:
                        at_sigterm = event  # the user is speaking: the utterance is in flight
                        asr.popen.send_signal(signal.SIGTERM)
                        await not_serving(asr.target)
                        late = requests(asr_pb2.RecognizeRequest(config=recognition_config("late")), hold=True)
                        refusal = await expect_error(stub.StreamingRecognize(late), grpc.StatusCode.UNAVAILABLE)
            except grpc.aio.AioRpcError as error:
                return error, asyncio.get_running_loop().time()
            raise AssertionError("the stream ended with OK")

        (ended, ended_at), (idle_ended, idle_ended_at) = await asyncio.gather(speak(), idle)
        assert await exit_code(asr) == 0

    assert at_sigterm is not None, [e.WhichOneof("event") for e in events]
    assert refusal == REFUSED
    finals = [e for e in events if e.WhichOneof("event") == "final"]
    assert len(finals) == 1 and events[-1] is finals[0], [e.WhichOneof("event") for e in events]
    final = finals[0]
    assert final.speech_end_ms > at_sigterm.audio_received_ms, "the speech went on after the SIGTERM"
    assert word_error_rate(TRANSCRIPTS["spk1_snt1"], final.final.text) <= max_wer("spk1_snt1"), final.final.text
    assert (ended.code(), ended.details()) == (grpc.StatusCode.UNAVAILABLE, ENDED)
    assert (idle_ended.code(), idle_ended.details()) == (grpc.StatusCode.UNAVAILABLE, ENDED)
    assert not quiet, "silence makes no events"
    assert idle_ended_at < ended_at, "the stream between turns ended at once, not after the utterance in flight"


# ---- TTS -------------------------------------------------------------------------------------------------------
FIRST = "The first reply is spoken to its very end, although the server was told to stop while it spoke it."
SECOND = ("The second reply had begun, ", "and its last words came after the drain began.")
THIRD = "A reply begun during the drain is left to another replica."


def text(utterance_id: int, delta: str) -> tts_pb2.SynthesizeRequest:
    return tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=utterance_id, text=delta))


def flush(utterance_id: int) -> tts_pb2.SynthesizeRequest:
    return tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=utterance_id))


def synthesis_config(session_id: str) -> tts_pb2.SynthesizeRequest:
    config = tts_pb2.SynthesisConfig(
        session_id=session_id, sample_rate_hz=16000, encoding=audio_pb2.AUDIO_ENCODING_PCM16LE
    )
    return tts_pb2.SynthesizeRequest(config=config)


async def test_tts_speaks_the_text_it_was_given_then_sends_the_stream_elsewhere() -> None:
    """SIGTERM mid-utterance: the utterances given text before it are spoken to their `done` (the rest of one
    arriving during the drain), one begun during the drain is not, then UNAVAILABLE; a new stream is refused."""
    drain_seen = asyncio.Event()
    call_over = asyncio.Event()

    async def replies() -> AsyncIterator[tts_pb2.SynthesizeRequest]:
        yield synthesis_config("busy")
        yield text(1, FIRST)
        yield flush(1)
        yield text(2, SECOND[0])
        await drain_seen.wait()
        yield text(2, SECOND[1])
        yield flush(2)
        yield text(3, THIRD)
        yield flush(3)
        await call_over.wait()  # the stream stays open, as the gateway's does

    events: list[tts_pb2.SynthesizeEvent] = []
    refusal = ""
    async with service("tts") as tts, grpc.aio.insecure_channel(tts.target) as channel:
        stub = tts_pb2_grpc.SynthesizerStub(channel)
        try:
            async for event in stub.StreamingSynthesize(replies()):
                events.append(event)
                if len(events) == 1:  # the first audio of utterance 1: the rest of it is still to be synthesized
                    tts.popen.send_signal(signal.SIGTERM)
                    await not_serving(tts.target)
                    late = stub.StreamingSynthesize(requests(synthesis_config("late"), hold=True))
                    refusal = await expect_error(late, grpc.StatusCode.UNAVAILABLE)
                    drain_seen.set()
            raise AssertionError("the stream ended with OK")
        except grpc.aio.AioRpcError as error:
            ended = error
        finally:
            call_over.set()
        assert await exit_code(tts) == 0

    assert refusal == REFUSED
    assert (ended.code(), ended.details()) == (grpc.StatusCode.UNAVAILABLE, ENDED)
    assert events[0].WhichOneof("event") == "audio" and events[0].audio.utterance_id == 1
    done = {e.done.utterance_id: e.done.audio_ms for e in events if e.WhichOneof("event") == "done"}
    assert list(done) == [1, 2] and events[-1].WhichOneof("event") == "done", "both spoken to their end, then over"
    for utterance_id, words in ((1, FIRST), (2, "".join(SECOND))):
        frames = [e.audio for e in events if e.WhichOneof("event") == "audio" and e.audio.utterance_id == utterance_id]
        assert done[utterance_id] == 20 * len(frames)
        assert " ".join(f.text for f in frames if f.chunk_end) == words.strip()
    assert all(e.audio.utterance_id != 3 for e in events if e.WhichOneof("event") == "audio")


# ---- LLM -------------------------------------------------------------------------------------------------------
class ScriptedEngine:
    """An LLM engine whose replies wait for the test: the first words at once, the rest once `release` is set."""

    model_name = "scripted"
    capabilities = EngineCapabilities(max_concurrency=4)

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def start(self) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk(text="Hello", queue_ms=0.0, ttft_ms=1.0)
        await self.release.wait()
        yield GenerationChunk(text=" there.", finish_reason="stop", prompt_tokens=3, completion_tokens=2)

    @property
    def waiting(self) -> int:
        return 0

    async def close(self) -> None:
        pass


async def test_llm_finishes_the_replies_in_flight_and_refuses_new_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LLM service as built by its main (the engine scripted): a reply being generated when the drain begins
    finishes whole, with OK; a new Generate is refused with UNAVAILABLE; the stop is over as soon as it is."""
    engine = ScriptedEngine()
    monkeypatch.setattr(llm_server, "build_engine", lambda settings: engine)
    server = llm_server.build_server(llm_server.LlmSettings(port=0, drain_grace_s=20))
    await server.start()
    target = f"127.0.0.1:{server.port}"
    request = llm_pb2.GenerateRequest(
        session_id="drain", messages=[llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content="Hi")]
    )
    stopping: asyncio.Future[None] | None = None
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = llm_pb2_grpc.GeneratorStub(channel)
            reply = aiter(stub.Generate(request))
            first = await anext(reply)
            stopping = asyncio.ensure_future(server.stop())
            await not_serving(target)
            refusal = await expect_error(stub.Generate(request), grpc.StatusCode.UNAVAILABLE)
            still_draining = not stopping.done()
            engine.release.set()
            rest = [response async for response in reply]
        await asyncio.wait_for(stopping, 5)
    finally:
        if stopping is None:
            await server.stop()
    assert refusal == REFUSED
    assert still_draining, "the server waited for the reply in flight"
    assert first.text_delta + "".join(r.text_delta for r in rest) == "Hello there."
    assert rest[-1].finish_reason == llm_pb2.FINISH_REASON_STOP


# ---- gateway: the WebSocket door -----------------------------------------------------------------------------------
async def test_a_stopping_gateway_plays_the_reply_to_its_end_over_the_websocket(services: dict[str, str]) -> None:
    """SIGTERM mid-reply: the reply's audio goes on to its end, a new WebSocket session is refused saying why, and
    then the page's socket closes with 1001 and a reason that says the gateway is shutting down."""
    gateway = await start_gateway(services["asr"], services["llm"], services["tts"], drain_grace_s=20)
    stopping: asyncio.Future[None] | None = None
    try:
        async with aiohttp.ClientSession() as client:
            talk = await open_ws(client, gateway)
            # The user goes on sending (silence) all along, as a page's microphone does.
            speaking = asyncio.ensure_future(talk.send_clip(load_clip("spk2_snt1"), trailing_silence_s=40.0))
            async with asyncio.timeout(60):
                while not talk.audio:  # polled as WebSocketTalk.wait_for polls its events
                    assert not talk._reader.done(), talk.events
                    await asyncio.sleep(0.02)
            frames_at_stop = len(talk.audio)
            stopping = asyncio.ensure_future(gateway.stop())
            await not_serving(f"127.0.0.1:{gateway.port}")
            late = await open_ws(client, gateway)
            await late.closed(timeout_s=10)
            await talk.closed(timeout_s=30)
            speaking.cancel()
            await asyncio.gather(speaking, return_exceptions=True)
        await asyncio.wait_for(stopping, 30)
    finally:
        if stopping is None:
            await gateway.stop()

    assert (late.close_code, late.of("error")[0]["code"]) == (1001, "UNAVAILABLE")
    assert "shutting down" in late.close_reason and "another replica" in late.close_reason, late.close_reason
    assert talk.close_code == 1001 and "shutting down" in talk.close_reason, (talk.close_code, talk.close_reason)
    assert len(talk.audio) > frames_at_stop, "the reply's audio went on after the stop"
    errors = [(e["stage"], e["code"], e["message"]) for e in talk.of("error")]  # why a reply ended early, if one did
    last_turn = talk.audio[-1][1]
    done = [e for e in talk.of("reply_done") if e["turn_index"] == last_turn]
    assert done and done[0]["text"], f"the reply being spoken at the stop was played to its end; errors: {errors}"
    for metrics in talk.of("metrics"):
        sent = sum(1 for _, turn, _ in talk.audio if turn == metrics["turn_index"])
        assert metrics["reply_audio_ms"] == 20 * sent, "every frame of the reply reached the page"


# ---- past the grace --------------------------------------------------------------------------------------------
class Unfinishing:
    """A call whose work never finishes: only the end of the grace ends it."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[object] = asyncio.Queue()

    async def wind_down(self) -> None:
        await asyncio.Event().wait()

    def end(self) -> None:
        self.events.put_nowait(Draining())


class EndlessRecognizer(asr_pb2_grpc.RecognizerServicer):
    def __init__(self) -> None:
        self.calls = OpenCalls()
        self.opened = asyncio.Event()

    @stream_handler
    async def StreamingRecognize(
        self, request_iterator: AsyncIterator[asr_pb2.RecognizeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[object]:
        async def read() -> None:
            async for _ in request_iterator:
                pass

        call = Unfinishing()
        with self.calls.hold(call):
            self.opened.set()
            async for event in merge_reader(read(), call.events):
                yield event


async def test_past_the_grace_a_busy_stream_is_sent_elsewhere_all_the_same() -> None:
    """A stream still busy when drain_grace_s is over ends then with the same UNAVAILABLE (the client replays its
    utterance elsewhere), not cut as CANCELLED; the stop takes the grace and little more."""
    servicer = EndlessRecognizer()
    server = Server(
        ServerSettings(port=0, drain_grace_s=0.5),
        ["voicemesh.v1.Recognizer"],
        lambda grpc_server: asr_pb2_grpc.add_RecognizerServicer_to_server(servicer, grpc_server),
        drain=servicer.calls.drain,
    )
    await server.start()
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(
            requests(asr_pb2.RecognizeRequest(config=recognition_config("endless")), hold=True)
        )
        await servicer.opened.wait()
        stop_started = loop.time()
        await server.stop()
        stop_s = loop.time() - stop_started
        ended = await expect_error(call, grpc.StatusCode.UNAVAILABLE)
    assert ended == ENDED
    assert 0.5 <= stop_s < 0.5 + END_GRACE_S, stop_s
