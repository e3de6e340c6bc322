"""Bounds on what a session holds, with fake backends: memory that stays flat over many turns, a maximum session
length on every door, and the doors' cut-off for a client that stops reading (gRPC, WebSocket, WebRTC)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway import websocket
from gateway.browser import BrowserSession
from gateway.downlink import DownlinkWatch
from gateway.grpc_door import ConversationServicer
from gateway.options import PipelineOptions, SessionOptions
from gateway.playout import Playout
from gateway.protocol import CLOSE_FULL, CLOSE_IDLE
from gateway.registry import SessionRegistry
from gateway.session import ReplyFrame, Session
from gateway.settings import GatewaySettings
from gateway.webrtc import EVENTS_CHANNEL, MAX_BUFFERED_BYTES, MAX_PENDING_EVENTS, WebRtcOptions, WebRtcPeer
from gateway.websocket import WebSocketTransport
from tests.unit.fake_backends import FRAMES_PER_WORD, FakeBackends, until
from tests.unit.test_web_parts import FakeWebSocket, reply_frame
from voicemesh.v1 import asr_pb2, audio_pb2, conversation_pb2, conversation_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
QUESTION = "what is the weather going to be like on the coast this weekend"
REPLY = "Sunny, warm."  # 6 frames: all within the playout's lead, so a turn takes no real time
FRAMES_PER_TURN = 25  # 500 ms of the user's audio per turn
HISTORY_MAX_CHARS = 600


# ---- memory across turns -------------------------------------------------------------------------------------------
class Conversation:
    """A user who asks QUESTION every turn, the ASR's events for it, and a transport that plays each reply."""

    def __init__(self, history_max_chars: int) -> None:
        self.backends = FakeBackends(reply=REPLY)
        options = SessionOptions("bounds", 16000, 16000, "", "", PipelineOptions())
        self.session = Session(options, self.backends, [], history_max_chars=history_max_chars)  # type: ignore[arg-type]
        self.budget = history_max_chars or float("inf")
        self.audio_ms = 0
        self.most_queued = 0  # reply frames in the playout at once
        self.player = self.session.playout.start(self._play)

    async def _play(self, frame: ReplyFrame, sent_us: int) -> None:
        self.most_queued = max(self.most_queued, self.session.playout.queued + 1)

    async def turn(self) -> None:
        """The user's audio, the ASR's events for it, then the reply until its metrics: the end of the turn."""
        for _ in range(FRAMES_PER_TURN):
            self.audio_ms += 20
            self.session.push_frame(audio_pb2.AudioFrame(data=bytes(640), capture_time_us=self.audio_ms * 1000))
        start_ms = self.audio_ms - 20 * FRAMES_PER_TURN
        self.backends.say(speech_started=asr_pb2.SpeechStarted(), speech_start_ms=start_ms)
        self.backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text=QUESTION), speech_end_ms=self.audio_ms)
        self.backends.say(final=asr_pb2.Final(text=QUESTION), speech_start_ms=start_ms, speech_end_ms=self.audio_ms)
        while True:
            event = await self.session.events.get()  # (`measure` bounds the wait: no timer per event held here)
            assert isinstance(event, conversation_pb2.ConverseEvent), event
            if event.HasField("metrics"):
                break
        self.backends.forget()  # the fakes' own record of what they were sent

    def held(self) -> dict[str, int]:
        """The session's containers, and the tasks running its code."""
        session = self.session
        return {
            "history entries": len(session.history),
            "history characters within the budget": int(sum(len(e.text) for e in session.history) <= self.budget),
            "recent turns": len(session.recorder.recent),
            "replies": len(session._replies),
            "receipt times": len(session.recorder.receipt_us),
            "retained audio frames": len(session.asr.retained),
            "queued reply frames": session.playout.queued,
            "queued events": session.events.qsize(),
            "tasks": len(gateway_tasks()),
        }

    async def close(self) -> None:
        self.player.cancel()
        await asyncio.gather(self.player, return_exceptions=True)
        await self.session.close()


def gateway_tasks() -> list[asyncio.Task[Any]]:
    """The running tasks whose coroutine is the gateway's code."""
    gateway = str(REPO / "gateway")
    code = [(task, getattr(task.get_coro(), "cr_code", None)) for task in asyncio.all_tasks()]
    return [task for task, code in code if code is not None and code.co_filename.startswith(gateway)]


def traced_bytes() -> int:
    """Memory still held that the repo's code allocated (a gateway or voicemesh frame anywhere in its traceback)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [
            tracemalloc.Filter(True, str(REPO / "gateway" / "*"), all_frames=True),
            tracemalloc.Filter(True, str(REPO / "voicemesh" / "*"), all_frames=True),
            tracemalloc.Filter(False, "*/logging/*", all_frames=True),  # records a log handler may keep
        ]
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


async def measure(history_max_chars: int, warm_up: int, turns: int) -> tuple[dict[str, int], dict[str, int], int]:
    """The session's containers after `warm_up` turns and after `turns` more, and the traced growth in between."""
    tracemalloc.start(4)  # frames kept per allocation: the repo's code that called a library is in most of them
    conversation = Conversation(history_max_chars)
    try:
        async with asyncio.timeout(60):
            for _ in range(warm_up):
                await conversation.turn()
            before, bytes_before = conversation.held(), traced_bytes()
            for _ in range(turns):
                await conversation.turn()
            after, bytes_after = conversation.held(), traced_bytes()
        assert conversation.most_queued <= len(REPLY.split()) * FRAMES_PER_WORD, "one reply's audio at most"
        return before, after, bytes_after - bytes_before
    finally:
        tracemalloc.stop()
        await conversation.close()


async def test_memory_per_session_stays_flat_over_200_turns() -> None:
    before, after, growth = await measure(HISTORY_MAX_CHARS, warm_up=50, turns=150)
    assert after == before | {"history entries": after["history entries"]}, (before, after)
    assert after["history entries"] <= 2 * HISTORY_MAX_CHARS // len(QUESTION)
    assert after["history characters within the budget"] == 1
    assert after["queued reply frames"] == 0 and after["replies"] == 0 and after["queued events"] == 0
    # What is left is CPython's own: it levels off (~14, 10, 7, 6, 3 KB per 100 turns here), where a leak would not.
    assert growth < 150 * 256, f"{growth} bytes more after 150 more turns ({growth / 150:.0f} per turn)"


async def test_the_memory_measure_sees_a_session_that_keeps_every_turn() -> None:
    """The check above can fail: with the history unbounded, the same measure sees it grow by each turn's text."""
    before, after, growth = await measure(0, warm_up=20, turns=60)
    assert after["history entries"] - before["history entries"] == 120
    assert growth > 60 * 512, f"only {growth} bytes more after 60 turns ({growth / 60:.0f} per turn)"


# ---- the maximum session length ------------------------------------------------------------------------------------
class FakeContext:
    """What Converse uses of a grpc.aio.ServicerContext; `abort` records the status the call ends with."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.aborted_at = 0.0

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status, self.aborted_at = (code, details), time.monotonic()
        raise grpc.aio.AbortError(details)


def registry_with(backends: FakeBackends, **settings: Any) -> SessionRegistry:
    registry = SessionRegistry(GatewaySettings(**settings))
    registry.backends = backends  # type: ignore[assignment]  # FakeBackends fakes the three streams
    return registry


async def held_open(config: conversation_pb2.SessionConfig) -> AsyncIterator[conversation_pb2.ConverseRequest]:
    """A client's requests: the config, then nothing, and the stream stays open (the server ends the call)."""
    yield conversation_pb2.ConverseRequest(config=config)
    await asyncio.get_running_loop().create_future()


async def test_a_grpc_session_ends_at_its_maximum_length_after_the_reply_being_spoken() -> None:
    backends = FakeBackends(reply=" ".join(["word"] * 30))  # 90 frames: 1.7 s of reply audio
    registry = registry_with(backends, max_session_s=0.5, drain_grace_s=10.0)
    context = FakeContext()
    received: list[tuple[str, float]] = []
    started_s = time.monotonic()
    config = conversation_pb2.SessionConfig(input_sample_rate_hz=16000)
    with pytest.raises(grpc.aio.AbortError):
        async for event in ConversationServicer(registry).Converse(held_open(config), context):
            kind = event.WhichOneof("event") or ""
            received.append((kind, time.monotonic()))
            if kind == "started":
                backends.say(speech_started=asr_pb2.SpeechStarted())
                backends.say(final=asr_pb2.Final(text="tell me a story"))
    assert context.status is not None
    code, message = context.status
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (
        message == "the session reached its maximum length of 0.5 s; start a new one (the conversation is remembered)"
    )
    kinds = [kind for kind, _ in received]
    assert kinds[-2:] == ["reply_done", "metrics"] and kinds.count("reply_audio") == 30 * FRAMES_PER_WORD
    first_audio_s = next(at for kind, at in received if kind == "reply_audio")
    assert first_audio_s - started_s < 0.5 < context.aborted_at - started_s, "the reply began before the limit"
    assert not registry.active, "the session ended with the call"


class Page:
    """A browser door's transport as a page sees it: the messages, the close. After `reads` messages it stops
    reading, and each later send waits for ever, as one into a full socket does."""

    def __init__(self, downlink: DownlinkWatch, reads: int = 1_000_000) -> None:
        self.downlink = downlink
        self.reads = reads
        self.sent: list[dict[str, Any]] = []
        self.closed: tuple[int, str] | None = None

    async def send_json(self, message: dict[str, Any]) -> None:
        with self.downlink.sending():
            if len(self.sent) >= self.reads:
                await asyncio.get_running_loop().create_future()
            self.sent.append(message)

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


async def browser_session(registry: SessionRegistry, downlink_stall_s: float = 10.0) -> BrowserSession:
    config = conversation_pb2.SessionConfig(input_sample_rate_hz=16000)
    session = await registry.open_session(config, door="websocket")
    return BrowserSession(registry, session, 60.0, "websocket", downlink_stall_s)


async def test_a_browser_session_is_closed_at_its_maximum_length_saying_so() -> None:
    registry = registry_with(FakeBackends(), max_session_s=0.2)
    browser = await browser_session(registry)
    page = Page(browser.downlink)
    started_s = time.monotonic()
    await asyncio.wait_for(browser.run(page, asyncio.get_running_loop().create_future()), 5)
    reason = "the session reached its maximum length of 0.2 s; start a new one (the conversation is remembered)"
    assert page.closed == (CLOSE_IDLE, reason)
    assert time.monotonic() - started_s >= 0.2
    assert [m["type"] for m in page.sent] == ["started", "error"]
    assert page.sent[-1]["code"] == "DEADLINE_EXCEEDED" and not page.sent[-1]["recoverable"]
    assert not registry.active


async def test_with_no_maximum_length_a_session_gets_no_timer() -> None:
    registry = registry_with(FakeBackends(), max_session_s=0)
    browser = await browser_session(registry)
    assert not registry._length_limits
    await registry.end_session(browser.session)


# ---- clients that stop reading -------------------------------------------------------------------------------------
async def test_the_downlink_watch_tells_a_client_that_stopped_reading_from_a_slow_one() -> None:
    watch = DownlinkWatch(stall_s=0.1)
    for _ in range(5):  # slow: each send takes 60 ms, 300 ms in all, but each goes through
        with watch.sending():
            await asyncio.sleep(0.06)
    await asyncio.sleep(0.15)  # nothing to send for a while: not a stall either
    assert not watch.stalled.done()

    async def send_into_a_full_window() -> None:
        with watch.sending():
            await asyncio.get_running_loop().create_future()

    started_s = time.monotonic()
    stuck = asyncio.ensure_future(send_into_a_full_window())
    error = await asyncio.wait_for(asyncio.shield(watch.stalled), 2)
    assert time.monotonic() - started_s >= 0.1
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.message == "the client is not reading; nothing sent to it went through in 0.1 s, so the session ended"
    stuck.cancel()
    overflowing = DownlinkWatch()
    overflowing.overflow("its queue is full")
    assert overflowing.stalled.result().message == "the client is not reading; its queue is full, so the session ended"


async def test_a_grpc_client_that_stops_reading_is_cut_off_and_its_session_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.grpc_door")
    backends = FakeBackends(reply=" ".join(["x" * 1000] * 100))  # 100 KB of reply text: more than the window
    registry = registry_with(backends)
    server = grpc.aio.server()
    conversation_pb2_grpc.add_ConversationServicer_to_server(ConversationServicer(registry, 0.2), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        # No BDP probing: the client's window stays at its initial 64 KB.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0)]) as channel:
            config = conversation_pb2.SessionConfig(input_sample_rate_hz=16000)
            call = conversation_pb2_grpc.ConversationStub(channel).Converse(held_open(config))
            started = await call.read()
            assert isinstance(started, conversation_pb2.ConverseEvent) and started.HasField("started")
            (session,) = registry.active.values()
            backends.say(speech_started=asr_pb2.SpeechStarted())
            backends.say(final=asr_pb2.Final(text="tell me everything"))
            await until(lambda: not registry.active)  # the client reads nothing meanwhile
            assert all(task.done() for task in session._tasks), "its ASR and TTS streams ended"
            await until(lambda: "session ended" in caplog.messages)  # the handler's generator was closed too
            received = 0
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while await call.read() is not grpc.aio.EOF:  # what was on its way, then the status
                    received += 1
    finally:
        await server.stop(0)
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (ended.value.details() or "").startswith("the client is not reading; nothing sent to it went through in")
    # The whole reply is 400+ events (100 text deltas of 1 KB, 300 audio frames); what reached the client is what
    # fit in the flow-control windows (64 KB each way, ~70-100 events by the mix), and the rest was never sent.
    assert received < 250, f"the rest was never sent, yet {received} events arrived"


async def test_a_page_that_stops_reading_is_closed_saying_so() -> None:
    backends = FakeBackends(reply="Hello there friend.")
    registry = registry_with(backends)
    browser = await browser_session(registry, downlink_stall_s=0.2)
    page = Page(browser.downlink, reads=1)  # "started", then nothing more
    running = asyncio.ensure_future(browser.run(page, asyncio.get_running_loop().create_future()))
    await until(lambda: len(page.sent) == 1)
    backends.say(speech_started=asr_pb2.SpeechStarted())
    backends.say(final=asr_pb2.Final(text="what time is it"))
    await asyncio.wait_for(running, 5)
    assert page.closed is not None
    code, reason = page.closed
    assert code == CLOSE_FULL
    assert reason == "the client is not reading; nothing sent to it went through in 0.2 s, so the session ended"
    assert [m["type"] for m in page.sent] == ["started"], "no error event queued behind what it does not read"
    assert not registry.active and browser.session.playout.queued == 0


class FullSocket(FakeWebSocket):
    """A WebSocket whose page stopped reading: sends, and the close handshake, wait for ever."""

    async def send_bytes(self, data: bytes) -> None:
        await asyncio.get_running_loop().create_future()

    async def close(self, code: int, message: bytes) -> None:
        await asyncio.get_running_loop().create_future()


async def test_reply_audio_into_a_full_websocket_trips_the_watch_and_the_close_does_not_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(websocket, "CLOSE_TIMEOUT_S", 0.1)
    watch = DownlinkWatch(stall_s=0.1)
    playout: Playout[ReplyFrame] = Playout(lambda frame, sent_us: None)
    transport = WebSocketTransport(FullSocket(), playout, watch)  # type: ignore[arg-type]
    for index in range(20):
        playout.push(reply_frame(index))
    error = await asyncio.wait_for(asyncio.shield(watch.stalled), 2)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "not reading" in error.message
    await asyncio.wait_for(transport.close(CLOSE_FULL, error.message), 1)


class FakeChannel:
    """An open RTCDataChannel whose queue holds `buffered` bytes not sent yet."""

    label = EVENTS_CHANNEL
    readyState = "open"

    def __init__(self, buffered: int) -> None:
        self.bufferedAmount = buffered
        self.sent: list[str] = []

    def send(self, text: str) -> None:
        self.sent.append(text)

    def on(self, event: str, handler: object) -> None:
        pass


async def test_webrtc_events_wait_in_bounded_queues_and_past_them_the_page_is_not_reading() -> None:
    registry = registry_with(FakeBackends())
    options = WebRtcOptions.from_settings(GatewaySettings())
    before_open = await browser_session(registry)
    peer = WebRtcPeer(options, before_open)
    for index in range(MAX_PENDING_EVENTS):
        await peer.send_json({"type": "partial", "index": index})
    assert not before_open.downlink.stalled.done()
    await peer.send_json({"type": "partial"})
    assert "events wait for the page to open its 'events' data channel" in before_open.downlink.stalled.result().message
    await peer.pc.close()
    await registry.end_session(before_open.session)

    backed_up = await browser_session(registry)
    peer = WebRtcPeer(options, backed_up)
    channel = FakeChannel(buffered=MAX_BUFFERED_BYTES)
    peer.pc.emit("datachannel", channel)
    await peer.send_json({"type": "partial"})
    assert not backed_up.downlink.stalled.done()
    channel.bufferedAmount += 1
    await peer.send_json({"type": "partial"})
    assert "KiB of events wait on the data channel" in backed_up.downlink.stalled.result().message
    await peer.pc.close()
    await registry.end_session(backed_up.session)
