"""The load-test harness against the real local mesh, an unreachable target and gateways that fail."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import json
import math
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from tests.conftest import clip_path, free_port
from tests.unit.test_loadtest import REPORT_KEYS  # the keys users' tooling reads, written once
from voicemesh import cli
from voicemesh.clients import Credentials
from voicemesh.conversation import ConversationClient
from voicemesh.loadtest import LoadTestOptions, LoadTestReport, loadtest, run_loadtest
from voicemesh.stages import STAGE_NAMES
from voicemesh.v1 import conversation_pb2, conversation_pb2_grpc

pytestmark = pytest.mark.integration

CLIPS = ("spk1_snt1", "spk2_snt1")


def clip_paths() -> tuple[str, ...]:
    return tuple(str(clip_path(name)) for name in CLIPS)


def assert_complete(report: LoadTestReport, out_dir: Path, sessions: int, turns: int) -> None:
    """Every key, both files, every planned turn either ok with a V2V or failed with a status, counts that agree."""
    saved = json.loads((out_dir / "loadtest.json").read_text())
    assert set(saved) == REPORT_KEYS
    assert saved == json.loads(json.dumps(report.to_json()))
    html = (out_dir / "loadtest.html").read_text()
    assert html.count("<svg") == 3
    assert [(t.session, t.turn) for t in report.per_turn] == [(s, n) for s in range(sessions) for n in range(turns)]
    for turn in report.per_turn:
        if turn.ok:
            assert turn.v2v_ms is not None and turn.v2v_ms > 0, turn
            assert set(turn.stages_ms) == set(STAGE_NAMES)
        else:
            assert turn.status not in ("", "OK") and turn.v2v_ms is None, turn
    counts, statuses = report.turns, Counter(turn.status for turn in report.per_turn)
    assert counts.planned == sessions * turns
    assert (counts.ok, counts.not_started) == (statuses["OK"], statuses["NOT_STARTED"])
    assert counts.failed_by_error == {s: n for s, n in statuses.items() if s not in ("OK", "NOT_STARTED")}


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(services: dict[str, str]) -> AsyncIterator[str]:
    from gateway.server import GatewaySettings, build_server

    server = build_server(
        GatewaySettings(
            port=0,
            asr_target=services["asr"],
            llm_target=services["llm"],
            tts_target=services["tts"],
            drain_grace_s=1,
        )
    )
    await server.start()
    yield f"127.0.0.1:{server.port}"
    await server.stop()


async def test_two_sessions_of_two_turns_against_the_real_mesh(gateway: str, tmp_path: Path) -> None:
    options = LoadTestOptions(target=gateway, sessions=2, turns=2, audio=clip_paths(), ramp_s=0.5, duration_s=120)
    report = await loadtest(options, tmp_path)
    assert_complete(report, tmp_path, sessions=2, turns=2)
    assert report.turns.ok == 4, report.turns
    v2v = report.v2v_ms
    assert v2v.count == 4 and v2v.p50 and v2v.p95 and v2v.p99 and v2v.max
    assert v2v.p50 <= v2v.p95 <= v2v.p99 <= v2v.max
    for stage in ("endpoint", "asr_compute", "llm_first_token", "tts_first_audio"):
        p50 = report.stages_ms[stage].p50
        assert p50 is not None and p50 > 0, stage
    # Both sessions were live at once, and each spoke its clips in turn with a reply to each.
    assert max(count for _, count in report.live_sessions) == 2
    assert report.throughput.sessions_completed == 2
    for turn in report.per_turn:
        assert turn.user and turn.reply and not turn.interrupted
        assert turn.first_audio_s is not None and turn.speech_end_s is not None
        assert turn.first_audio_s > turn.speech_end_s
    said = {(t.session, t.turn): t.clip for t in report.per_turn}
    assert said[(0, 0)] != said[(1, 0)], "sessions start on different clips"
    # How far ahead of playout a reply's later chunks came; unset for a reply whose audio was all there before it
    # began to play (a speculative reply synthesized whole while the end of turn was decided), which with the fused
    # end of turn's longer waits may be every reply here.
    ahead = [turn.reply_ahead_min_ms for turn in report.per_turn if turn.reply_ahead_min_ms is not None]
    assert all(math.isfinite(ms) for ms in ahead)
    assert report.reply_ahead_min_ms.count == len(ahead)


@pytest_asyncio.fixture(loop_scope="session")
async def web_gateway(services: dict[str, str]) -> AsyncIterator[str]:
    """A gateway with its browser doors; yields the HTTP door, HOST:PORT."""
    from gateway.server import GatewaySettings, build_server

    server = build_server(
        GatewaySettings(
            port=0,
            http_port=0,
            asr_target=services["asr"],
            llm_target=services["llm"],
            tts_target=services["tts"],
            drain_grace_s=1,
            auth_token="load-test-token",
        )
    )
    await server.start()
    yield f"127.0.0.1:{server.http_port}"
    await server.stop()


async def test_sync_arrival_makes_every_session_speak_each_turn_at_once(gateway: str, tmp_path: Path) -> None:
    options = LoadTestOptions(target=gateway, sessions=2, turns=2, audio=clip_paths(), arrival="sync", duration_s=120)
    report = await loadtest(options, tmp_path)
    assert report.turns.ok == 4, report.per_turn
    for number in range(2):
        starts = [t.clip_start_s for t in report.per_turn if t.turn == number]
        assert None not in starts and max(starts) - min(starts) < 0.1, starts  # type: ignore[type-var,operator]


async def test_the_websocket_door_under_load_as_browsers_use_it(web_gateway: str, tmp_path: Path) -> None:
    credentials = Credentials(token="load-test-token")
    options = LoadTestOptions(
        target=web_gateway, transport="ws", sessions=2, turns=2, audio=clip_paths(), ramp_s=0.5, credentials=credentials
    )
    report = await loadtest(options, tmp_path)
    assert_complete(report, tmp_path, sessions=2, turns=2)
    assert report.turns.ok == 4, report.per_turn
    for turn in report.per_turn:
        assert turn.user and turn.reply and turn.v2v_ms is not None and turn.v2v_ms > 0
        assert turn.stages_ms["downlink"] > 0, "the client reported its first audio, as a page does"


async def test_a_websocket_refusal_fails_the_turns_with_the_gateways_status(web_gateway: str, tmp_path: Path) -> None:
    options = LoadTestOptions(target=web_gateway, transport="ws", sessions=1, turns=2, audio=clip_paths(), ramp_s=0)
    report = await loadtest(options, tmp_path)  # no token
    assert report.turns.ok == 0
    assert report.turns.failed_by_error == {"UNAUTHENTICATED": 2}


async def test_the_realtime_door_under_load_as_sdk_clients_use_it(web_gateway: str, tmp_path: Path) -> None:
    credentials = Credentials(token="load-test-token")
    options = LoadTestOptions(
        target=web_gateway, transport="realtime", sessions=2, turns=2, audio=clip_paths(), credentials=credentials
    )
    report = await loadtest(options, tmp_path)
    assert_complete(report, tmp_path, sessions=2, turns=2)
    assert report.turns.ok == 4, report.per_turn
    for turn in report.per_turn:
        assert turn.user and turn.reply and turn.v2v_ms is not None and turn.v2v_ms > 0
    refused = await loadtest(dataclasses.replace(options, credentials=Credentials(), sessions=1), tmp_path / "refused")
    assert refused.turns.failed_by_error == {"UNAUTHENTICATED": 2}


async def test_an_unreachable_target_gives_failed_turns_with_their_status(tmp_path: Path) -> None:
    options = LoadTestOptions(target=f"127.0.0.1:{free_port()}", sessions=2, turns=3, audio=clip_paths(), ramp_s=0)
    report = await loadtest(options, tmp_path)
    assert_complete(report, tmp_path, sessions=2, turns=3)
    assert report.turns.ok == 0
    assert report.turns.failed_by_error == {"UNAVAILABLE": 6}
    assert report.v2v_ms.count == 0 and report.v2v_ms.p99 is None
    assert report.throughput.sessions_completed == 0


def test_the_command_on_an_unreachable_target_exits_non_zero_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    argv = ["loadtest", "--target", f"127.0.0.1:{port}", "--sessions", "1", "--turns", "1", "--ramp-s", "0"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--audio", *clip_paths(), "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1
    assert "UNAVAILABLE x1" in out and str(tmp_path / "loadtest.html") in out
    assert "Traceback" not in out + err


def test_the_command_refuses_a_remote_target(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["loadtest", "--target", "192.0.2.10:50051", "--audio", *clip_paths()])
    assert exit_info.value.code == 2
    assert "--allow-remote" in capsys.readouterr().err


class RefusingGateway(conversation_pb2_grpc.ConversationServicer):
    """A gateway at its session limit."""

    async def Converse(self, request_iterator, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this gateway is at its limit of 0 sessions")
        yield conversation_pb2.ConverseEvent()


class FirstCallInternalGateway(RefusingGateway):
    """Refuses every session; its first call ends INTERNAL, as grpcio reports a refusal that raced the config's
    write (grpc/grpc#36066); with `always`, every call does."""

    def __init__(self, always: bool = False) -> None:
        self.calls, self.always = 0, always

    async def Converse(self, request_iterator, context):
        self.calls += 1
        if self.calls == 1 or self.always:
            await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
        async for event in super().Converse(request_iterator, context):
            yield event


@pytest.mark.parametrize(("always", "code", "calls"), [(False, "RESOURCE_EXHAUSTED", 2), (True, "INTERNAL", 2)])
async def test_a_refusal_grpcio_reports_as_internal_is_asked_once_more_for_the_gateways_status(
    always: bool, code: str, calls: int
) -> None:
    servicer = FirstCallInternalGateway(always)
    server = grpc.aio.server()
    conversation_pb2_grpc.add_ConversationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with ConversationClient(f"127.0.0.1:{port}", conversation_pb2.SessionConfig(), reconnect_attempts=0) as c:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in c.events():
                    pass
    finally:
        await server.stop(0)
    assert raised.value.code().name == code and servicer.calls == calls


class TtsDownGateway(conversation_pb2_grpc.ConversationServicer):
    """Ends each turn (speech, then 10 silent frames) with a TTS error and metrics, but never any reply audio."""

    async def Converse(self, request_iterator, context):
        turn, speaking, silent, speech_end_us = 0, False, 0, 0
        yield conversation_pb2.ConverseEvent(started=conversation_pb2.SessionStarted(session_id="fake"))
        async for request in request_iterator:
            if request.WhichOneof("request") != "frame":
                continue
            if any(request.frame.data):
                speaking, silent, speech_end_us = True, 0, request.frame.capture_time_us
                continue
            silent += 1
            if speaking and silent == 10:
                speaking = False
                error = conversation_pb2.SessionError(
                    stage="tts", code="UNAVAILABLE", message="tts service: connection refused", recoverable=True
                )
                yield conversation_pb2.ConverseEvent(turn_index=turn, error=error)
                metrics = conversation_pb2.TurnMetrics(speech_end_capture_us=speech_end_us, endpoint_ms=200)
                yield conversation_pb2.ConverseEvent(turn_index=turn, metrics=metrics)
                turn += 1


@pytest.mark.parametrize(
    ("servicer", "statuses"),
    [(RefusingGateway, {"RESOURCE_EXHAUSTED": 4}), (TtsDownGateway, {"tts:UNAVAILABLE": 4})],
)
async def test_a_failing_gateway_gives_failed_turns_with_their_status(
    servicer: type, statuses: dict[str, int], tmp_path: Path
) -> None:
    server = grpc.aio.server()
    conversation_pb2_grpc.add_ConversationServicer_to_server(servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        options = LoadTestOptions(
            target=f"127.0.0.1:{port}", sessions=2, turns=2, audio=clip_paths(), ramp_s=0, pause_s=(0.1, 0.1)
        )
        report = await loadtest(options, tmp_path)
    finally:
        await server.stop(0)
    assert_complete(report, tmp_path, sessions=2, turns=2)
    assert report.turns.failed_by_error == statuses
    assert all(turn.detail for turn in report.per_turn), "each failed turn says why"


async def test_the_duration_limit_stops_the_test_and_fails_what_was_running(tmp_path: Path) -> None:
    """A gateway that never answers: the test ends at its time limit, not at the turn timeout."""

    class SilentGateway(conversation_pb2_grpc.ConversationServicer):
        async def Converse(self, request_iterator, context):
            yield conversation_pb2.ConverseEvent(started=conversation_pb2.SessionStarted(session_id="fake"))
            async for _ in request_iterator:
                pass

    server = grpc.aio.server()
    conversation_pb2_grpc.add_ConversationServicer_to_server(SilentGateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        options = LoadTestOptions(target=f"127.0.0.1:{port}", sessions=1, turns=3, audio=clip_paths(), duration_s=4)
        report = await loadtest(options, tmp_path)
    finally:
        await server.stop(0)
    assert_complete(report, tmp_path, sessions=1, turns=3)
    assert report.turns.failed_by_error == {"DURATION_LIMIT": 1}
    assert report.turns.not_started == 2


def test_run_loadtest_returns_a_report_that_serialises_to_json() -> None:
    options = LoadTestOptions(target=f"127.0.0.1:{free_port()}", sessions=1, turns=1, audio=clip_paths())
    report = run_loadtest(options)
    assert report.files is None
    assert json.loads(json.dumps(report.to_json()))["turns"]["failed_by_error"] == {"UNAVAILABLE": 1}


class AbortingGateway(conversation_pb2_grpc.ConversationServicer):
    """Reads a little audio, then ends the call with a status (a synchronous servicer: its own threads)."""

    def Converse(self, request_iterator, context):
        yield conversation_pb2.ConverseEvent(started=conversation_pb2.SessionStarted(session_id="fake"))
        for count, _ in enumerate(request_iterator):
            if count == 30:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a second SessionConfig was sent")


def test_the_command_against_a_call_that_fails_midway_ends_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    gc.collect()  # tasks left by earlier tests in this process die now, not during this test
    caplog.clear()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    conversation_pb2_grpc.add_ConversationServicer_to_server(AbortingGateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["loadtest", "--target", f"127.0.0.1:{port}", "--audio", *clip_paths(), "--out", str(tmp_path)])
    finally:
        server.stop(0)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1
    assert "FAILED_PRECONDITION x4" in out
    # Nothing left pending for the event loop to complain about on its way out.
    noise = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not noise and "Traceback" not in err, noise
