"""The load-test harness without a mesh: percentile math on known data, capacity and queue growth, options, HTML."""

from __future__ import annotations

import random
import wave
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from voicemesh import loadstats, report_html
from voicemesh.loadtest import (
    LoadTestError,
    LoadTestOptions,
    check_options,
    format_summary,
    is_loopback,
    load_clips,
    parse_levels,
)
from voicemesh.stages import QUEUE_STAGES, STAGE_NAMES


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([15, 20, 35, 40, 50], 50, 35),
        ([15, 20, 35, 40, 50], 40, 29),  # rank 1.6: 20 + 0.6 * 15
        ([15, 20, 35, 40, 50], 0, 15),
        ([15, 20, 35, 40, 50], 100, 50),
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 75, 3.25),
        (list(range(1, 101)), 95, 95.05),
        (list(range(1, 101)), 99, 99.01),
        ([7], 99, 7),
        ([3, 1, 2], 50, 2),  # unsorted input
    ],
)
def test_percentile_interpolates_linearly_between_closest_ranks(values: list[float], q: float, expected: float) -> None:
    assert loadstats.percentile(values, q) == pytest.approx(expected)


def test_percentile_matches_numpys_default_method_on_random_data() -> None:
    rng = random.Random(7)
    for size in (2, 3, 10, 57, 1000):
        values = [rng.lognormvariate(6, 0.5) for _ in range(size)]
        for q in (1, 50, 90, 95, 99, 99.9):
            assert loadstats.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_refuses_no_values_and_q_outside_0_100() -> None:
    with pytest.raises(ValueError, match="no values"):
        loadstats.percentile([], 50)
    with pytest.raises(ValueError, match="outside"):
        loadstats.percentile([1.0], 101)


def test_summarize_known_data_and_empty() -> None:
    summary = loadstats.summarize([100.0, 200.0, 300.0, 400.0, 1000.0])
    assert summary == {"count": 5, "p50": 300.0, "p95": 880.0, "p99": 976.0, "max": 1000.0, "mean": 400.0}
    assert loadstats.summarize([]) == {"count": 0, "p50": None, "p95": None, "p99": None, "max": None, "mean": None}


def test_live_sessions_counts_overlapping_spans() -> None:
    steps = loadstats.live_sessions([(0.0, 10.0), (1.0, 5.0), (5.0, 8.0)])
    assert steps == [(0.0, 1), (1.0, 2), (5.0, 2), (8.0, 1), (10.0, 0)]


def _level(sessions: int, within: bool, **queues: float) -> dict[str, object]:
    medians = dict.fromkeys(QUEUE_STAGES, 1.0) | queues
    return {"sessions": sessions, "within_budget": within, "queue_medians_ms": medians}


def test_capacity_is_the_last_consecutive_level_within_budget() -> None:
    assert loadstats.capacity([_level(1, True), _level(2, True), _level(4, False), _level(8, True)]) == 2
    assert loadstats.capacity([_level(4, True), _level(1, True)]) == 4
    assert loadstats.capacity([_level(1, False), _level(2, True)]) == 0


def test_queue_growth_names_the_first_stage_past_the_threshold() -> None:
    levels = [
        _level(1, True),
        _level(2, True, tts_queue=12.0),  # under the 25 ms threshold
        _level(4, False, llm_queue=400.0, gateway_hold=60.0),
        _level(8, False, llm_queue=900.0, asr_queue=2000.0),
    ]
    growth = loadstats.queue_growth(levels, threshold_ms=25.0)
    assert growth["stage"] == "llm_queue"
    assert growth["at_sessions"] == 4 and growth["grew_ms"] == 399.0 and growth["baseline_sessions"] == 1
    assert growth["growth_ms"]["8"]["asr_queue"] == 1999.0  # type: ignore[index]


def test_queue_growth_with_nothing_growing_or_one_level() -> None:
    assert loadstats.queue_growth([_level(1, True), _level(2, True, llm_queue=5.0)])["stage"] is None
    assert loadstats.queue_growth([_level(1, True)])["stage"] is None


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


def test_ws_transport_is_reported_unavailable(tmp_path: Path) -> None:
    with pytest.raises(LoadTestError, match="ws is unavailable"):
        check_options(LoadTestOptions(transport="ws", audio=(str(_wav(tmp_path / "a.wav")),)))


@pytest.mark.parametrize(
    ("fields", "words"),
    [({"sessions": 0}, "sessions=0"), ({"turns": 1000}, "turns=1000"), ({"audio": ()}, "no audio")],
)
def test_options_out_of_bounds_are_refused(tmp_path: Path, fields: dict[str, object], words: str) -> None:
    options = LoadTestOptions(audio=(str(_wav(tmp_path / "a.wav")),))
    with pytest.raises(LoadTestError, match=words):
        check_options(LoadTestOptions(**(options.__dict__ | fields)))


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


def _report(ok_v2v: list[float], failed: int) -> dict[str, object]:
    """A report as build_report shapes it, from made-up turns."""
    turns = [
        {
            "session": i % 2,
            "turn": i // 2,
            "clip": "spk1_snt1",
            "status": "OK",
            "ok": True,
            "detail": "",
            "v2v_ms": v2v,
            "server_v2v_ms": v2v - 5,
            "stages_ms": dict.fromkeys(STAGE_NAMES, v2v / 20),
            "clip_start_s": i * 2.0,
            "clip_end_s": i * 2.0 + 1.5,
            "speech_end_s": i * 2.0 + 1.4,
            "first_audio_s": i * 2.0 + 1.4 + v2v / 1000,
            "user": "The child almost hurt the small dog.",
            "reply": "<oh no>",
        }
        for i, v2v in enumerate(ok_v2v)
    ]
    turns += [
        {
            "session": 9,
            "turn": k,
            "clip": "x",
            "status": "UNAVAILABLE",
            "ok": False,
            "detail": "connection refused",
            "v2v_ms": None,
            "server_v2v_ms": None,
            "stages_ms": {},
            "clip_start_s": 0.5,
            "clip_end_s": None,
            "speech_end_s": None,
            "first_audio_s": None,
            "user": "",
            "reply": "",
        }
        for k in range(failed)
    ]
    return {
        "config": {"target": "127.0.0.1:1", "transport": "grpc", "sessions": 2, "turns": 2, "ramp_s": 1.0, "clips": []},
        "wall_s": 12.5,
        "turns": {
            "planned": len(turns),
            "ok": len(ok_v2v),
            "failed": failed,
            "not_started": 0,
            "failed_by_error": {"UNAVAILABLE": failed} if failed else {},
        },
        "throughput": {"ok_turns_per_min": 9.6},
        "v2v_ms": loadstats.summarize(ok_v2v),
        "stages_ms": {s: loadstats.summarize([v / 20 for v in ok_v2v]) for s in STAGE_NAMES},
        "live_sessions": [[0.0, 0], [0.1, 1], [0.6, 2], [11.0, 1], [12.4, 0]],
        "per_turn": turns,
    }


def _svgs(html: str) -> list[ET.Element]:
    """Each inline <svg> parsed as XML: they must be well-formed to render."""
    chunks = html.split("<svg")[1:]
    return [ET.fromstring("<svg" + chunk.split("</svg>")[0] + "</svg>") for chunk in chunks]


def test_html_report_has_the_three_charts_and_escapes_text() -> None:
    html = report_html.render_report(_report([420.0, 510.0, 640.0, 1200.0], failed=2))
    titles = [svg.find("{http://www.w3.org/2000/svg}title").text for svg in _svgs(html)]  # type: ignore[union-attr]
    assert titles == ["V2V CDF", "V2V over time against live sessions", "Stages stacked at p50, p95, p99"]
    assert "<oh no>" not in html and "&lt;oh no&gt;" in html
    assert "UNAVAILABLE" in html and html.startswith("<!DOCTYPE html>")


def test_html_report_with_no_completed_turns_still_renders() -> None:
    html = report_html.render_report(_report([], failed=3))
    assert len(_svgs(html)) == 3 and "no completed turns" in html


def test_summary_table_lists_every_stage_and_the_failures() -> None:
    text = format_summary(_report([420.0, 510.0], failed=1))
    assert "V2V" in text and all(stage in text for stage in STAGE_NAMES)
    assert "UNAVAILABLE x1" in text and "connection refused" in text


def test_html_sweep_report_links_each_level() -> None:
    level = {
        "sessions": 1,
        "within_budget": True,
        "turns_ok": 2,
        "turns_failed": 0,
        "v2v_p50_ms": 600.0,
        "v2v_p95_ms": 700.0,
        "v2v_p99_ms": 710.0,
        "ok_turns_per_min": 6.0,
        "queue_medians_ms": dict.fromkeys(QUEUE_STAGES, 1.0),
        "report": {"html": "/out/sessions-1/loadtest.html"},
    }
    result = {
        "target": "127.0.0.1:1",
        "transport": "grpc",
        "turns_per_session": 2,
        "budget_ms": 1500.0,
        "levels": [level, level | {"sessions": 2, "report": {"html": "/out/sessions-2/loadtest.html"}}],
        "verdict": "2 session(s) within budget",
        "files": {"html": "/out/sweep.html"},
    }
    html = report_html.render_sweep(result)
    assert 'href="sessions-1/loadtest.html"' in html and 'href="sessions-2/loadtest.html"' in html
    assert len(_svgs(html)) == 2


def test_nice_ticks_cover_the_range_with_round_steps() -> None:
    assert report_html.nice_ticks(0, 1234) == [0, 500, 1000, 1500]
    assert report_html.nice_ticks(0, 1.0) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
