"""The load-test harness without a mesh: summaries, capacity and queue growth, options, clips, the report's JSON
keys, the HTML pages, the speech-end rule and the pacing shared with `talk`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import wave
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from voicemesh import clients
from voicemesh.clients import Credentials
from voicemesh.conversation import speech_end_sent_us
from voicemesh.loadstats import Summary, summarize
from voicemesh.loadtest import LoadTestError, LoadTestOptions, check_options, is_loopback, load_clips
from voicemesh.loadtest import cli as loadtest_cli
from voicemesh.loadtest.capacity import capacity, queue_growth, verdict
from voicemesh.loadtest.cli import options_from_args, parse_levels
from voicemesh.loadtest.driver import Rendezvous
from voicemesh.loadtest.html_report import nice_ticks, render_report, render_sweep
from voicemesh.loadtest.report import (
    LoadTestReport,
    Machine,
    ReportFiles,
    SessionRow,
    SweepLevel,
    SweepResult,
    TurnRow,
    build_report,
    format_summary,
    live_sessions,
)
from voicemesh.stages import QUEUE_STAGES, STAGE_NAMES

REPORT_KEYS = {
    "kind",
    "config",
    "started_at_us",
    "wall_s",
    "machine",
    "turns",
    "throughput",
    "percentile_method",
    "v2v_ms",
    "stages_ms",
    "replies_with_gap",
    "reply_ahead_min_ms",
    "endpoint_scores",
    "live_sessions",
    "sessions",
    "per_turn",
    "files",
}
TURN_KEYS = {
    "session",
    "turn",
    "clip",
    "status",
    "ok",
    "detail",
    "v2v_ms",
    "server_v2v_ms",
    "stages_ms",
    "clip_start_s",
    "clip_end_s",
    "speech_end_s",
    "first_audio_s",
    "user",
    "reply",
    "interrupted",
    "reply_gap_ms",
    "reply_ahead_min_ms",
    "extra_server_turns",
    "errors",
    "hangover_ms",
    "turn_score_ms",
    "turn_end_from_prefill",
}
SUMMARY_KEYS = {"count", "p50", "p95", "p99", "max", "mean"}
LEVEL_KEYS = {
    "sessions",
    "within_budget",
    "v2v_p50_ms",
    "v2v_p95_ms",
    "v2v_p99_ms",
    "v2v_max_ms",
    "turns_ok",
    "turns_failed",
    "failed_by_error",
    "ok_turns_per_min",
    "replies_with_gap",
    "queue_medians_ms",
    "stage_p99_ms",
    "report",
}


def test_summarize_interpolates_percentiles_linearly_between_closest_ranks() -> None:
    # p95 of 5 values is at rank 3.8: 400 + 0.8 * (1000 - 400); p99 at rank 3.96.
    summary = summarize([100.0, 200.0, 300.0, 1000.0, 400.0])
    assert summary == Summary(count=5, p50=300.0, p95=880.0, p99=976.0, max=1000.0, mean=400.0)
    assert summarize([7.0]) == Summary(count=1, p50=7.0, p95=7.0, p99=7.0, max=7.0, mean=7.0)


def test_summarize_no_values_and_its_json() -> None:
    assert summarize([]).to_json() == dict.fromkeys(SUMMARY_KEYS, None) | {"count": 0}
    assert set(summarize([1.0, 2.0]).to_json()) == SUMMARY_KEYS


def test_live_sessions_counts_overlapping_spans() -> None:
    steps = live_sessions([(0.0, 10.0), (1.0, 5.0), (5.0, 8.0)])
    assert steps == [(0.0, 1), (1.0, 2), (5.0, 2), (8.0, 1), (10.0, 0)]


def _level(sessions: int, within: bool, report: ReportFiles | None = None, **queues: float) -> SweepLevel:
    return SweepLevel(
        sessions=sessions,
        within_budget=within,
        v2v_p50_ms=600.0,
        v2v_p95_ms=700.0,
        v2v_p99_ms=710.0 + sessions,
        v2v_max_ms=720.0,
        turns_ok=2 * sessions,
        turns_failed=0,
        failed_by_error={},
        ok_turns_per_min=6.0,
        replies_with_gap=0,
        queue_medians_ms=dict.fromkeys(QUEUE_STAGES, 1.0) | queues,
        stage_p99_ms=dict.fromkeys(STAGE_NAMES, 5.0),
        report=report,
    )


def test_capacity_is_the_last_consecutive_level_within_budget() -> None:
    assert capacity([_level(1, True), _level(2, True), _level(4, False), _level(8, True)]) == 2
    assert capacity([_level(4, True), _level(1, True)]) == 4
    assert capacity([_level(1, False), _level(2, True)]) == 0


def test_queue_growth_names_the_first_stage_past_the_threshold() -> None:
    levels = [
        _level(1, True),
        _level(2, True, tts_queue=12.0),  # under the 25 ms threshold
        _level(4, False, llm_queue=400.0, gateway_hold=60.0),
        _level(8, False, llm_queue=900.0, asr_queue=2000.0),
    ]
    growth = queue_growth(levels, threshold_ms=25.0)
    assert growth.stage == "llm_queue"
    assert growth.at_sessions == 4 and growth.grew_ms == 399.0 and growth.baseline_sessions == 1
    assert growth.growth_ms["2"]["tts_queue"] == 11.0 and growth.growth_ms["8"]["asr_queue"] == 1999.0
    text = verdict(levels, capacity(levels), 1500.0, growth)
    assert text.startswith("2 session(s) within budget: p99 V2V 712.0 ms <= 1500 ms")
    assert "llm_queue grew first: +399.0 ms median at 4 sessions vs 1" in text


def test_queue_growth_with_nothing_growing_or_one_level() -> None:
    levels = [_level(1, True), _level(2, False, llm_queue=5.0)]
    growth = queue_growth(levels)
    assert growth.stage is None and growth.growth_ms == {"2": dict.fromkeys(QUEUE_STAGES, 0.0) | {"llm_queue": 4.0}}
    assert verdict(levels, 1, 1500.0, growth).endswith("; no queue median grew by more than 25 ms")
    alone = queue_growth([_level(1, True)])
    assert alone.stage is None and alone.baseline_sessions is None and alone.growth_ms == {}


@pytest.mark.parametrize(
    ("target", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("127.3.4.5:1", True),
        ("localhost:50051", True),
        ("[::1]:50051", True),
        ("unix:/tmp/gateway.sock", True),
        ("10.0.0.7:50051", False),
        ("[2001:db8::1]:50051", False),
        ("gateway.example.com:443", False),
    ],
)
def test_is_loopback(target: str, loopback: bool) -> None:
    assert is_loopback(target) is loopback


def _wav(path: Path, seconds: float = 1.0, silent: bool = False) -> Path:
    t = np.arange(int(16000 * seconds)) / 16000
    samples = np.zeros_like(t) if silent else 0.3 * np.sin(2 * np.pi * 220 * t) * (t < seconds / 2)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((samples * 32767).astype("<i2").tobytes())
    return path


def test_options_refuse_remote_targets_unless_allowed(tmp_path: Path) -> None:
    audio = (str(_wav(tmp_path / "a.wav")),)
    with pytest.raises(LoadTestError, match="--allow-remote"):
        check_options(LoadTestOptions(target="10.1.2.3:50051", audio=audio))
    check_options(LoadTestOptions(target="10.1.2.3:50051", audio=audio, allow_remote=True))


def test_the_ws_transport_is_accepted(tmp_path: Path) -> None:
    check_options(LoadTestOptions(transport="ws", audio=(str(_wav(tmp_path / "a.wav")),)))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"sessions": 0}, "sessions=0"),
        ({"turns": 1000}, "turns=1000"),
        ({"audio": ()}, "no audio"),
        ({"transport": "udp"}, "use one of grpc, ws"),
        ({"arrival": "bursty"}, "use one of staggered, sync"),
        ({"pause_s": (2.0, 1.0)}, "0 <= low <= high"),
    ],
)
def test_options_out_of_bounds_are_refused(tmp_path: Path, fields: dict[str, object], words: str) -> None:
    options = LoadTestOptions(audio=(str(_wav(tmp_path / "a.wav")),))
    with pytest.raises(LoadTestError, match=words):
        check_options(dataclasses.replace(options, **fields))


def test_flags_left_out_keep_the_options_defaults() -> None:
    names = ("target", "sessions", "turns", "transport", "ramp_s", "arrival", "think_s", "duration_s", "turn_timeout_s")
    args = argparse.Namespace(**dict.fromkeys(names), audio=["a.wav"], allow_remote=False)
    assert options_from_args(args) == LoadTestOptions(audio=("a.wav",))
    args.sessions, args.ramp_s, args.arrival, args.think_s = 8, 0.0, "sync", "2"
    expected = LoadTestOptions(audio=("a.wav",), sessions=8, ramp_s=0.0, arrival="sync", pause_s=(2.0, 2.0))
    assert options_from_args(args) == expected
    args.think_s = "0.5,3"
    assert options_from_args(args).pause_s == (0.5, 3.0)
    args.think_s = "soon"
    with pytest.raises(LoadTestError, match="--think-s"):
        options_from_args(args)


def test_clips_from_a_directory_are_sorted_and_trimmed_after_the_speech(tmp_path: Path) -> None:
    _wav(tmp_path / "b.wav", seconds=2.0)
    _wav(tmp_path / "a.wav", seconds=1.0)
    clips = load_clips([tmp_path])
    assert [clip.name for clip in clips] == ["a", "b"]
    # Speech is the first half; the silent half is cut down to 100 ms after the last speech frame.
    assert clips[1].duration_s == pytest.approx(1.1, abs=0.03)
    assert clips[1].is_speech[0] and not clips[1].is_speech[-1]


def test_clips_that_cannot_be_used_are_refused_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(LoadTestError, match="no such file"):
        load_clips([tmp_path / "missing.wav"])
    with pytest.raises(LoadTestError, match=r"no \.wav files"):
        load_clips([tmp_path])
    with pytest.raises(LoadTestError, match="no speech"):
        load_clips([_wav(tmp_path / "quiet.wav", silent=True)])
    (tmp_path / "junk.wav").write_bytes(b"not a wav")
    with pytest.raises(LoadTestError, match=r"junk\.wav"):
        load_clips([tmp_path / "junk.wav"])


def test_parse_levels() -> None:
    assert parse_levels("1,2,4,8") == [1, 2, 4, 8]
    for bad in ("", "1,x", "0,2"):
        with pytest.raises(LoadTestError, match="--sweep"):
            parse_levels(bad)


def test_speech_ends_at_the_last_speech_frame_sent_up_to_one_frame_past_the_servers_end() -> None:
    sent = [(1_000_000, True), (1_020_000, True), (1_040_000, False), (1_060_000, True), (1_080_000, False)]
    assert speech_end_sent_us(sent, server_speech_end_us=1_030_000) == 1_020_000
    # A frame of noise after the server's end (and more than one frame past it) is not speech.
    assert speech_end_sent_us(sent, server_speech_end_us=1_039_000) == 1_020_000
    assert speech_end_sent_us(sent, server_speech_end_us=1_041_000) == 1_060_000
    assert speech_end_sent_us([(5, False)], server_speech_end_us=1_234) == 1_234


def test_pacer_keeps_an_absolute_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    delays: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        delays.append(round(seconds, 6))
        now[0] += seconds

    monkeypatch.setattr(clients.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(clients.asyncio, "sleep", fake_sleep)

    async def run() -> None:
        pacer = clients.Pacer()
        await pacer.wait()  # frame 0: due now
        await pacer.wait()  # frame 1: 20 ms later
        now[0] += 0.015  # the caller took 15 ms: frame 2 (at 40 ms) is due in 5 ms, not 20
        await pacer.wait()
        now[0] += 0.1  # far behind: frames go out at once until the schedule is met again
        await pacer.wait()
        await pacer.wait()

    with pytest.raises(StopIteration):  # nothing really sleeps, so one step runs it to the end
        run().send(None)
    assert delays == [0.02, 0.005]


def _turn(session: int, turn: int, v2v_ms: float | None, status: str = "OK", detail: str = "") -> TurnRow:
    ok = status == "OK"
    return TurnRow(
        session=session,
        turn=turn,
        clip="spk1_snt1",
        status=status,
        ok=ok,
        detail=detail,
        v2v_ms=v2v_ms,
        server_v2v_ms=None if v2v_ms is None else v2v_ms - 5,
        stages_ms=dict.fromkeys(STAGE_NAMES, v2v_ms / 20) if v2v_ms is not None else {},
        clip_start_s=turn * 2.0 if status != "NOT_STARTED" else None,
        clip_end_s=turn * 2.0 + 1.5 if ok else None,
        speech_end_s=turn * 2.0 + 1.4 if ok else None,
        first_audio_s=turn * 2.0 + 1.4 + v2v_ms / 1000 if v2v_ms is not None else None,
        user="The child almost hurt the small dog." if ok else "",
        reply="<oh no>" if ok else "",
    )


def _report(ok_v2v: list[float], failed: int, not_started: int = 0, out_dir: Path | None = None) -> LoadTestReport:
    """A report built from made-up turns: the OK ones in sessions 0 and 1, the failed ones in session 2."""
    turns = [_turn(index % 2, index // 2, v2v) for index, v2v in enumerate(ok_v2v)]
    turns += [_turn(2, k, None, "UNAVAILABLE", "connection refused") for k in range(failed)]
    turns += [_turn(2, failed + k, None, "NOT_STARTED") for k in range(not_started)]
    sessions = [SessionRow(index, f"loadtest-x-{index}", 0.1 * index, 12.0, "") for index in range(3)]
    return build_report(
        LoadTestOptions(
            target="127.0.0.1:1", sessions=3, turns=2, audio=("a.wav",), credentials=Credentials(token="sekrit-token")
        ),
        [],
        sessions,
        turns,
        started_at_us=1_700_000_000_000_000,
        wall_s=12.5,
        files=None if out_dir is None else ReportFiles.under(out_dir, "loadtest"),
    )


def test_report_counts_summarises_and_keeps_its_json_keys(tmp_path: Path) -> None:
    report = _report([420.0, 510.0, 640.0], failed=2, not_started=1, out_dir=tmp_path)
    assert dataclasses.asdict(report.turns) == {
        "planned": 6,
        "ok": 3,
        "failed": 2,
        "not_started": 1,
        "failed_by_error": {"UNAVAILABLE": 2},
    }
    assert report.throughput.sessions_completed == 2 and report.throughput.ok_turns_per_min == 14.4
    assert report.v2v_ms.count == 3 and report.v2v_ms.p50 == 510.0 and report.stages_ms["upload"].max == 32.0
    assert report.live_sessions == [(0.0, 1), (0.1, 2), (0.2, 3), (12.0, 0)]
    assert report.files is not None
    report.files.write(report.to_json(), render_report(report))
    saved = json.loads(Path(report.files.json).read_text())
    assert set(saved) == REPORT_KEYS and saved["kind"] == "voicemesh.loadtest"
    assert "sekrit-token" not in Path(report.files.json).read_text() + Path(report.files.html).read_text()
    # Every option but the credentials and the carrier's token (a token must never land in a report file).
    secrets = {"credentials", "twilio_auth_token"}
    assert set(saved["config"]) == {f.name for f in dataclasses.fields(LoadTestOptions)} - secrets | {"clips"}
    assert set(saved["turns"]) == {"planned", "ok", "failed", "not_started", "failed_by_error"}
    assert set(saved["throughput"]) == {"ok_turns_per_min", "sessions_completed"}
    assert set(saved["machine"]) == {"host", "cpus", "python"}
    assert set(saved["v2v_ms"]) == SUMMARY_KEYS and set(saved["stages_ms"]) == set(STAGE_NAMES)
    assert saved["live_sessions"][1] == [0.1, 2]
    assert set(saved["sessions"][0]) == {"session", "session_id", "started_s", "ended_s", "error"}
    assert all(set(turn) == TURN_KEYS for turn in saved["per_turn"])
    assert saved["files"] == {"json": str(tmp_path / "loadtest.json"), "html": str(tmp_path / "loadtest.html")}
    assert "files" not in _report([420.0], failed=0).to_json()


def _sweep(levels: list[SweepLevel], files: ReportFiles | None = None) -> SweepResult:
    growth = queue_growth(levels)
    return SweepResult(
        target="127.0.0.1:1",
        transport="grpc",
        turns_per_session=2,
        budget_ms=1500.0,
        levels_requested=[level.sessions for level in levels],
        levels=levels,
        capacity_sessions=capacity(levels),
        first_queue_to_grow=growth,
        machine=Machine.here(),
        verdict=verdict(levels, capacity(levels), 1500.0, growth),
        files=files,
    )


def test_sweep_json_keeps_its_keys() -> None:
    result = _sweep([_level(1, True, ReportFiles.under("/out/sessions-1", "loadtest")), _level(2, False)])
    data = json.loads(json.dumps(result.to_json()))
    assert set(data) == {
        "kind",
        "target",
        "transport",
        "turns_per_session",
        "budget_ms",
        "levels_requested",
        "levels",
        "capacity_sessions",
        "first_queue_to_grow",
        "machine",
        "verdict",
    }
    assert data["kind"] == "voicemesh.sweep" and data["capacity_sessions"] == 1
    assert all(set(level) == LEVEL_KEYS for level in data["levels"])
    assert data["levels"][0]["report"]["html"] == "/out/sessions-1/loadtest.html" and data["levels"][1]["report"] == {}
    assert set(data["first_queue_to_grow"]) == {
        "stage",
        "at_sessions",
        "grew_ms",
        "threshold_ms",
        "baseline_sessions",
        "growth_ms",
    }


def _svgs(html: str) -> list[ET.Element]:
    """Each inline <svg> parsed as XML: they must be well-formed to render."""
    chunks = html.split("<svg")[1:]
    return [ET.fromstring("<svg" + chunk.split("</svg>")[0] + "</svg>") for chunk in chunks]


def test_html_report_has_the_three_charts_and_escapes_text() -> None:
    html = render_report(_report([420.0, 510.0, 640.0, 1200.0], failed=2))
    titles = [svg.findtext("{http://www.w3.org/2000/svg}title") for svg in _svgs(html)]
    assert titles == ["V2V CDF", "V2V over time against live sessions", "Stages stacked at p50, p95, p99"]
    assert "<oh no>" not in html and "&lt;oh no&gt;" in html
    assert "UNAVAILABLE" in html and html.startswith("<!DOCTYPE html>")
    assert "no completed turns" not in html


def test_html_report_with_no_completed_turns_still_renders() -> None:
    html = render_report(_report([], failed=3))
    assert len(_svgs(html)) == 3 and html.count("no completed turns to plot") == 2  # the timeline shows failures


def test_summary_table_lists_every_stage_and_the_failures() -> None:
    text = format_summary(_report([420.0, 510.0], failed=1))
    assert "V2V" in text and all(stage in text for stage in STAGE_NAMES)
    assert "ms (n=2)" in text and "UNAVAILABLE x1" in text and "connection refused" in text
    assert "reply gaps: 0 of 2 replies ran dry" in text


def test_replies_that_ran_dry_are_counted_and_summed() -> None:
    report = _report([420.0, 510.0, 640.0], failed=1)
    gapped = [
        dataclasses.replace(turn, reply_gap_ms=ms) if turn.ok else turn
        for turn, ms in zip(report.per_turn, (0, 120.0, 380.0, 900.0), strict=True)
    ]
    report = dataclasses.replace(report, per_turn=gapped)
    assert report.replies_with_gap == 2  # the failed turn's gap is not a reply's
    assert report.to_json()["replies_with_gap"] == 2
    assert "reply gaps: 2 of 3 replies ran dry, longest 380 ms, 500 ms in all" in format_summary(report)


def test_how_far_ahead_of_playout_later_chunks_came_is_summarized_over_replies_of_several_chunks() -> None:
    report = _report([420.0, 510.0, 640.0], failed=1)
    ahead = [
        dataclasses.replace(turn, reply_ahead_min_ms=ms) if turn.ok else turn
        for turn, ms in zip(report.per_turn, (None, 800.0, -200.0, 5.0), strict=True)
    ]
    report = dataclasses.replace(report, per_turn=ahead)
    assert report.reply_ahead_min_ms.count == 2  # a reply of one chunk (None) and a failed turn are left out
    assert report.to_json()["reply_ahead_min_ms"]["p50"] == 300.0
    assert "ahead of playout, the tightest per reply: p50 300 ms, least -200 ms (n=2)" in format_summary(report)


def test_pauses_are_counted_by_where_their_score_came_from() -> None:
    report = _report([420.0, 510.0, 640.0, 700.0], failed=1)
    scores = [(64, 0.1, True), (64, 180.0, False), (500, None, False), (None, None, False), (64, 90.0, True)]
    scored = [
        dataclasses.replace(turn, hangover_ms=hangover, turn_score_ms=score_ms, turn_end_from_prefill=prefill)
        for turn, (hangover, score_ms, prefill) in zip(report.per_turn, scores, strict=True)
    ]
    report = dataclasses.replace(report, per_turn=scored)
    # The turn without server metrics (None) and the failed one are left out.
    assert report.endpoint_scores == {"from_prefill": 1, "in_time": 1, "none_in_time": 1}
    assert report.to_json()["endpoint_scores"] == report.endpoint_scores
    assert "endpoint scores: 1 from a partial's prefill, 1 from the reply in time, 1 pauses took" in (
        format_summary(report)
    )


def test_html_sweep_report_links_each_level() -> None:
    levels = [_level(n, True, ReportFiles.under(f"/out/sessions-{n}", "loadtest")) for n in (1, 2)]
    result = _sweep(levels, ReportFiles.under("/out", "sweep"))
    html = render_sweep(result)
    assert 'href="sessions-1/loadtest.html"' in html and 'href="sessions-2/loadtest.html"' in html
    assert len(_svgs(html)) == 2


def test_nice_ticks_cover_the_range_with_round_steps() -> None:
    assert nice_ticks(0, 1234) == [0, 500, 1000, 1500]
    assert nice_ticks(0, 1.0) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]


async def test_sync_arrival_releases_a_turn_once_every_running_session_is_ready() -> None:
    rendezvous = Rendezvous(3)
    first = rendezvous.ready(0, 0)
    rendezvous.ready(1, 0)
    assert not first.is_set()
    rendezvous.leave(2)  # the third session failed before its first turn: nobody waits for it
    assert first.is_set()
    later = rendezvous.ready(0, 1)
    assert not later.is_set()
    rendezvous.ready(1, 1)
    assert later.is_set()


def _cli_args(**given: object) -> argparse.Namespace:
    names = ("target", "sessions", "turns", "transport", "ramp_s", "arrival", "think_s", "duration_s", "turn_timeout_s")
    flags = {**dict.fromkeys(names), "audio": ["a.wav"], "allow_remote": False, "sweep": None, "budget_ms": None}
    return argparse.Namespace(**{**flags, "sweep_all": False, "out": None, **given})


async def test_an_empty_target_runs_the_test_on_a_local_mesh_it_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started: list[str] = []
    tested: list[str] = []

    @contextlib.asynccontextmanager
    async def fake_mesh(prefix: str, door: str) -> AsyncIterator[str]:
        started.append(door)
        yield "127.0.0.1:9"

    async def fake_loadtest(options: LoadTestOptions, out_dir: Path) -> object:
        tested.append(options.target)
        raise LoadTestError("stop here")

    monkeypatch.setattr(loadtest_cli, "started_local_mesh", fake_mesh)
    monkeypatch.setattr(loadtest_cli, "loadtest", fake_loadtest)
    audio = [str(_wav(tmp_path / "a.wav"))]
    assert await loadtest_cli.command(_cli_args(target="", audio=audio)) == 2
    assert (started, tested) == (["grpc"], ["127.0.0.1:9"])

    # Flags out of bounds are refused before any mesh starts.
    assert await loadtest_cli.command(_cli_args(target="", audio=audio, sessions=0)) == 2
    assert started == ["grpc"]
