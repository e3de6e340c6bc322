"""The turn-end probe's file, its binding to a model, and the two ways engines read it (a whole row of logits, or
vLLM's log-probabilities of a few tokens)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from services.llm.turn_end import LineEndScorer, ProbeScorer, build_scorer, waits_ms
from services.llm.turn_probe import DEFAULT_PATH, ProbeMismatch, TurnEndProbe, log_softmax_at
from voicemesh.endpointing import EndpointingPolicy, TurnEndCalibration, lm_completeness

PIECES = {0: ".", 1: "?", 2: " and", 3: " the", 4: ",", 5: "\n", 6: " to", 7: "!"}
MODEL = "gemma3/gemma-3/270M/d640/l18"


def a_probe(model_id: str = MODEL) -> TurnEndProbe:
    return TurnEndProbe(
        model_id=model_id,
        pieces=(" and", " the", ","),
        token_weights=np.array([-0.8, -0.5, -0.3]),
        end_weight=1.2,
        top_weight=0.4,
        bias=0.7,
        complete_at=0.6,
        incomplete_at=0.3,
    )


def token_of(piece: str) -> int | None:
    return {text: token for token, text in PIECES.items()}.get(piece)


def test_a_probe_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "probe.npz"
    a_probe().save(path, trained_on="a test")
    loaded = TurnEndProbe.load(path)
    assert loaded.model_id == MODEL and loaded.pieces == (" and", " the", ",")
    assert loaded.end_weight == pytest.approx(1.2) and loaded.complete_at == pytest.approx(0.6)
    np.testing.assert_allclose(loaded.token_weights, [-0.8, -0.5, -0.3], rtol=1e-6)


def test_a_probe_for_another_model_or_a_missing_file_is_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "other.npz"
    a_probe("llama/llama-3/8B/d4096/l32").save(path)
    with pytest.raises(ProbeMismatch) as refused:
        build_scorer("probe", str(path), MODEL, np.array([0, 1]), token_of, None)
    assert str(path) in str(refused.value) and "llama/llama-3/8B" in str(refused.value) and MODEL in str(refused.value)
    with pytest.raises(ProbeMismatch, match="does not exist"):
        build_scorer("probe", str(tmp_path / "missing.npz"), MODEL, np.array([0, 1]), token_of, None)


def test_a_probe_reading_a_token_the_model_lacks_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "probe.npz"
    TurnEndProbe(MODEL, (" zyzzyva",), np.array([1.0]), 1.0, 0.0, 0.0, 0.6, 0.3).save(path)
    with pytest.raises(ProbeMismatch, match="zyzzyva"):
        build_scorer("probe", str(path), MODEL, np.array([0, 1]), token_of, None)


def test_the_probe_reads_the_same_from_a_row_of_logits_as_from_vllms_few_logprobs(tmp_path: Path) -> None:
    path = tmp_path / "probe.npz"
    a_probe().save(path)
    end_ids = np.array([0, 1, 5, 7])
    scorer = build_scorer("probe", str(path), MODEL, end_ids, token_of, None)
    assert isinstance(scorer, ProbeScorer)
    assert scorer.calibration == TurnEndCalibration(0.6, 0.3)  # the probe's own operating point
    rng = np.random.default_rng(3)
    for _ in range(20):
        logits = rng.normal(0, 3, size=len(PIECES)).astype(np.float32)
        total = math.log(np.exp(logits.astype(np.float64)).sum())
        logprobs = {token: float(logits[token]) - total for token in scorer.token_ids.tolist()}
        top = float(logits.max()) - total
        assert scorer.probability_of(logprobs, top) == pytest.approx(scorer.probability(logits), abs=1e-9)


def test_the_probe_is_a_logistic_over_its_features() -> None:
    probe = a_probe()
    bound = probe.bind(MODEL, token_of, DEFAULT_PATH)
    logits = np.array([2.0, 0.5, 1.0, -1.0, 0.0, 1.5, 0.2, -2.0])
    end_ids = np.array([0, 1, 5, 7])
    scores = log_softmax_at(logits, bound.token_ids, end_ids)
    z = 0.7 + scores[:3] @ probe.token_weights + 1.2 * scores[3] + 0.4 * scores[4]
    assert bound.probability(logits, end_ids) == pytest.approx(1 / (1 + math.exp(-z)))
    assert scores[3] == pytest.approx(math.log(np.exp(logits[end_ids]).sum() / np.exp(logits).sum()))
    assert scores[4] == pytest.approx(2.0 - math.log(np.exp(logits).sum()))


def test_line_end_keeps_the_models_own_probability_of_a_line_end() -> None:
    logits = np.array([2.0, 0.5, 1.0, -1.0, 0.0, 1.5, 0.2, -2.0])
    scorer = build_scorer("line_end", "", MODEL, np.array([0, 1, 5, 7]), token_of, None)
    assert isinstance(scorer, LineEndScorer) and scorer.calibration == TurnEndCalibration()
    expected = np.exp(logits[[0, 1, 5, 7]]).sum() / np.exp(logits).sum()
    assert scorer.probability(logits) == pytest.approx(expected)
    with pytest.raises(ValueError, match="turn_end_scorer='smart' unknown"):
        build_scorer("smart", "", MODEL, np.array([0]), token_of, None)


def test_the_many_point_waits_are_the_endpointers_own() -> None:
    policy = EndpointingPolicy()
    points = np.random.default_rng(0).random(500)
    for calibration in (TurnEndCalibration(), TurnEndCalibration(0.3, 0.1), TurnEndCalibration(0.95, 0.9)):
        expected = [policy.hangover_for(lm_completeness(calibration.standard(float(p)))) for p in points]
        np.testing.assert_array_equal(waits_ms(points, calibration, policy), expected)


def test_the_shipped_probe_loads_and_says_where_it_came_from() -> None:
    probe = TurnEndProbe.load(DEFAULT_PATH)
    assert probe.model_id.startswith("gemma3/")
    assert 0 < probe.incomplete_at < probe.complete_at < 1
    assert len(probe.pieces) == len(probe.token_weights)
    with np.load(DEFAULT_PATH) as data:
        assert "dstc8-schema-guided-dialogue" in str(data["trained_on"])
