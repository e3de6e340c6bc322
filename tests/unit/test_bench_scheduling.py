"""`python -m bench.scheduling`'s own logic: the variants it is given and what a level's pooled turns show."""

from __future__ import annotations

import pytest

from bench.scheduling import VARIANTS, level_summary
from bench.variants import parse_variant
from voicemesh.loadtest.report import TurnRow
from voicemesh.stages import QUEUE_STAGES


def turn(v2v_ms: float | None, ok: bool = True, gap_ms: float = 0.0, ahead_ms: float | None = None) -> TurnRow:
    return TurnRow(
        session=0,
        turn=0,
        clip="a.wav",
        status="OK" if ok else "TIMEOUT",
        ok=ok,
        detail="",
        v2v_ms=v2v_ms,
        server_v2v_ms=None,
        stages_ms={QUEUE_STAGES[0]: 10.0} if ok else {},
        clip_start_s=None,
        clip_end_s=None,
        speech_end_s=None,
        first_audio_s=None,
        user="",
        reply="",
        reply_gap_ms=gap_ms,
        reply_ahead_min_ms=ahead_ms,
    )


def test_a_variant_names_its_environment_and_only_voicemesh_variables() -> None:
    assert parse_variant("paced:VOICEMESH_LLM_MAX_AHEAD_S=3,VOICEMESH_ASR_PARTIAL_NICE=0") == (
        "paced",
        {"VOICEMESH_LLM_MAX_AHEAD_S": "3", "VOICEMESH_ASR_PARTIAL_NICE": "0"},
    )
    assert parse_variant("defaults:") == ("defaults", {})
    with pytest.raises(SystemExit, match="NAME:VOICEMESH_"):
        parse_variant("bad:PATH=/tmp")
    assert set(VARIANTS["fifo"]) == set(VARIANTS["deadline"]), "both variants set the same switches"


def test_a_level_counts_failed_turns_gaps_and_the_tightest_margins_and_is_over_budget_with_a_failure() -> None:
    rows = [turn(400.0, gap_ms=120.0, ahead_ms=-120.0), turn(600.0, ahead_ms=800.0), turn(500.0), turn(None, ok=False)]
    summary = level_summary(rows, budget_ms=1500.0)
    assert (summary["turns"], summary["failed"], summary["within_budget"]) == (4, 1, False)
    assert summary["v2v_ms"]["p50"] == 500.0 and summary["v2v_ms"]["count"] == 3
    assert (summary["replies_with_gap"], summary["gap_ms_total"], summary["gap_ms_longest"]) == (1, 120.0, 120.0)
    assert summary["reply_ahead_min_ms"]["count"] == 2
    assert summary["queue_p50_ms"][QUEUE_STAGES[0]] == 10.0
    assert level_summary(rows[:3], budget_ms=1500.0)["within_budget"] is True
    assert level_summary(rows[:3], budget_ms=550.0)["within_budget"] is False
