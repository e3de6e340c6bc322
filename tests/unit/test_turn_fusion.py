"""The learned end-of-turn fusion (services/asr/fusion.py): the shipped fits load and behave, a fit learns the side
each signal points to, and the ASR applies a fusion only where its signals are in."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from services.asr.completeness import TurnScorer
from services.asr.engine import Transcript
from services.asr.fusion import FUSION_PATH, TEXT_SCORERS, TurnEndFusion, TurnEndFusions
from services.asr.server import AsrSettings, RecognizerServicer
from voicemesh.endpointing import COMPLETE_AT, INCOMPLETE_AT, EndpointingPolicy, lm_completeness

SURE = Transcript("I would like a table for two.", avg_logprob=-0.15, no_speech_prob=0.01)
GARBLED = Transcript("Ferb a dun klee.", avg_logprob=-1.4, no_speech_prob=0.2)


@pytest.mark.parametrize("scorer", TEXT_SCORERS)
@pytest.mark.parametrize("audio", [False, True])
def test_every_text_scorer_has_a_shipped_fusion_with_and_without_audio(scorer: str, audio: bool) -> None:
    fusion = TurnEndFusions.load(FUSION_PATH).pick(scorer, audio)
    assert fusion.text_scorer == scorer and fusion.uses_audio == audio
    weights = fusion.weights_by_name()
    assert weights[scorer] > 0, "a higher P(turn end) from the LLM must read as more finished"
    if audio:
        assert weights["audio"] > 0, "a higher audio P must read as more finished"


@pytest.mark.parametrize("scorer", TEXT_SCORERS)
def test_the_shipped_fusions_wait_longer_for_a_less_sure_text_score(scorer: str) -> None:
    fusion = TurnEndFusions.load(FUSION_PATH).pick(scorer, audio=False)
    policy = EndpointingPolicy()
    seen = set()
    for logprob in (-0.1, -0.3, -0.6, -1.0):
        values = {"avg_logprob": logprob, "no_speech_prob": 0.02}
        waits = [
            policy.hangover_for(fusion.completeness(fusion.logit({**values, scorer: p})))
            for p in (0.9, 0.45, 0.2, 0.05)
        ]
        assert waits == sorted(waits), (logprob, waits)
        seen.update(waits)
    assert {policy.min_hangover_ms, policy.max_hangover_ms} <= seen, seen


def test_a_fit_learns_which_way_each_signal_points() -> None:
    rng = random.Random(3)
    points = []
    for _ in range(400):
        finished = rng.random() < 0.3
        points.append(
            {
                "finished": finished,
                "probe": min(0.99, max(0.01, rng.gauss(0.6 if finished else 0.2, 0.15))),
                "avg_logprob": rng.gauss(-0.3, 0.2),  # noise: says nothing about the turn
                "no_speech_prob": rng.random() * 0.1,
            }
        )
    fusion = TurnEndFusion.fit("t", ("probe", "avg_logprob", "no_speech_prob"), points)
    weights = fusion.weights_by_name()
    assert weights["probe"] > 1.0
    assert abs(weights["avg_logprob"]) < weights["probe"] / 3


def test_the_operating_point_maps_onto_the_completeness_scale() -> None:
    fusion = TurnEndFusion("t", ("probe",), (1.0,), 0.0, complete_at=1.0, incomplete_at=-1.0)
    assert fusion.completeness(1.0) == pytest.approx(COMPLETE_AT)
    assert fusion.completeness(-1.0) == pytest.approx(INCOMPLETE_AT)
    assert fusion.completeness(50.0) == 1.0 and fusion.completeness(-50.0) == 0.0


def test_a_fusion_without_its_operating_point_in_order_or_with_unknown_features_is_refused() -> None:
    with pytest.raises(ValueError, match="incomplete_at"):
        TurnEndFusion("t", ("probe",), (1.0,), 0.0, complete_at=-1.0, incomplete_at=1.0)
    with pytest.raises(ValueError, match="features"):
        TurnEndFusion("t", ("pitch",), (1.0,), 0.0)


def test_a_missing_fusion_names_those_there() -> None:
    fusions = TurnEndFusions((TurnEndFusion("probe+confidence", ("probe", "avg_logprob"), (1.0, 1.0), 0.0),))
    with pytest.raises(ValueError, match=r"'line_end'.*probe\+confidence"):
        fusions.pick("line_end", audio=False)


def test_the_asr_fuses_only_with_a_fusion_set_and_its_signals_in() -> None:
    fusion = TurnEndFusions.load(FUSION_PATH).pick("probe", audio=True)
    alone = TurnScorer(None)
    assert alone.with_language_model(SURE, 0.3, None) == lm_completeness(0.3)
    fused = TurnScorer(None, learned=fusion)
    assert fused.with_language_model(SURE, 0.3, None) == lm_completeness(0.3), "no audio score: the LLM's alone"
    values = {"probe": 0.3, "audio": 0.8, "avg_logprob": SURE.avg_logprob, "no_speech_prob": SURE.no_speech_prob}
    assert fused.with_language_model(SURE, 0.3, 0.8) == fusion.completeness(fusion.logit(values))


def test_a_garbled_draft_reads_less_finished_than_a_sure_one() -> None:
    fusion = TurnEndFusions.load(FUSION_PATH).pick("probe", audio=False)
    scorer = TurnScorer(None, learned=fusion)
    assert scorer.with_language_model(GARBLED, 0.5, None) < scorer.with_language_model(SURE, 0.5, None)


def test_an_unknown_turn_fusion_setting_stops_the_asr_naming_the_choices() -> None:
    servicer = RecognizerServicer(AsrSettings(turn_fusion="bigger"))
    with pytest.raises(ValueError, match=r"turn_fusion='bigger'.*probe or line_end"):
        servicer.load()


def test_log_odds_of_the_extremes_stay_finite() -> None:
    fusion = TurnEndFusions.load(FUSION_PATH).pick("line_end", audio=True)
    value = fusion.logit({"line_end": 1.0, "audio": 0.0, "avg_logprob": -50.0, "no_speech_prob": 1.0})
    assert math.isfinite(value)


def test_whisper_end_enters_a_fusion_that_weighs_it_and_its_absence_leaves_the_llm_alone() -> None:
    fusion = TurnEndFusion("t", ("line_end", "whisper_end"), (1.0, 1.0), 0.0, complete_at=1.0, incomplete_at=-1.0)
    scorer = TurnScorer(None, learned=fusion)
    heard = Transcript("Book a table.", avg_logprob=-0.2, end_probability=0.9)
    unsure = Transcript("Book a table", avg_logprob=-0.2, end_probability=0.1)
    assert scorer.with_language_model(heard, 0.5, None) > scorer.with_language_model(unsure, 0.5, None)
    unknown = Transcript("Book a table.", avg_logprob=-0.2)  # the decode's words did not map onto its tokens
    assert scorer.with_language_model(unknown, 0.5, None) == lm_completeness(0.5)


def test_a_point_missing_a_signal_is_left_out_of_a_fit_and_scores_nan() -> None:
    points = [
        {"finished": i % 2 == 0, "line_end": 0.7 if i % 2 == 0 else 0.2, "whisper_end": 0.5 if i % 3 else None}
        for i in range(60)
    ]
    fusion = TurnEndFusion.fit("t", ("line_end", "whisper_end"), points)
    assert fusion.weights_by_name()["line_end"] > 0
    logits = fusion.logits(points)
    assert np.isnan(logits[0]) and not np.isnan(logits[1])


def test_auc_counts_finished_points_above_inside_ones_and_leaves_missing_scores_out() -> None:
    from bench.turn_fusion import auc

    finished = np.array([True, True, False, False, False])
    assert auc(np.array([0.9, 0.8, 0.1, 0.2, 0.3]), finished) == 1.0
    assert auc(np.array([0.1, 0.2, 0.9, 0.8, 0.7]), finished) == 0.0
    assert auc(np.array([0.5, 0.5, 0.5, 0.5, 0.5]), finished) == 0.5  # ties count half
    assert auc(np.array([0.9, np.nan, 0.1, np.nan, 0.95]), finished) == 0.5
    assert auc(np.array([0.9, 0.8, np.nan, np.nan, np.nan]), finished) is None


def test_read_speech_is_cut_where_its_transcript_says_the_speaker_goes_on() -> None:
    from bench.turn_fusion import pauses_of
    from services.asr.engine import WordTiming

    said = "He came home. Then he slept, and dreamt"
    words = [WordTiming(w, i * 0.3, i * 0.3 + 0.25, 0.9) for i, w in enumerate(said.split())]
    assert pauses_of(said, words, None, "x") == (True, list(range(1, 8))), "a known finished utterance: every end"
    finished, ends = pauses_of(said, words, 10, "x")
    assert not finished, "a transcript ending without a full stop was cut mid-sentence: its end is no turn end"
    assert ends == [1, 2, 4, 5, 6, 7], "never after 'home.', where the speaker may have been done"
    finished, ends = pauses_of(said + " deeply.", [*words, WordTiming("deeply.", 2.4, 2.7, 0.9)], 2, "x")
    assert finished and len(ends) == 2 and 3 not in ends
    assert pauses_of(said + " deeply.", [*words, WordTiming("deeply.", 2.4, 2.7, 0.9)], 2, "x")[1] == ends, "seeded"


def test_the_room_tone_after_a_cut_is_at_the_recordings_own_floor() -> None:
    from bench.smart_turn_pause import room_tone

    rng = np.random.default_rng(0)
    speech = np.sin(np.arange(16000) / 5).astype(np.float32) * 0.3
    quiet = (rng.standard_normal(16000) * 0.001).astype(np.float32)  # 1 s of the room at 0.001 RMS
    recording = np.concatenate([np.zeros(1600, np.float32), quiet, speech])  # leading digital silence is no floor
    tone = room_tone(recording, 200, rng)
    assert len(tone) == 200 * 16
    assert 0.0007 < float(np.sqrt(np.mean(tone**2))) < 0.0013
