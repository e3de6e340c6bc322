import re

import pytest

from services.asr.endpointing import Endpointer, EndpointingPolicy, Event
from voicemesh.endpointing import (
    LM_COMPLETE_AT,
    LM_INCOMPLETE_AT,
    TurnEndCalibration,
    lm_completeness,
    policy_from,
    to_proto,
)
from voicemesh.errors import RequestError
from voicemesh.v1 import asr_pb2

FIXED = EndpointingPolicy(candidate_silence_ms=150, hangover_ms=300, fixed_hangover=True)


def run(
    probabilities: list[float],
    policy: EndpointingPolicy = FIXED,
    scores: dict[int, float] | None = None,
    decisive: bool = True,
) -> list[tuple[int, Event]]:
    """Feed windows; `scores` gives a pause's completeness score when its window `index` is reached (a language
    model's with `decisive`, else the transcript's)."""
    endpointer = Endpointer(policy, window_ms=32)
    events = []
    for index, p in enumerate(probabilities):
        for event in endpointer.push(p):
            events.append((endpointer.now_ms, event))
        if scores and index in scores:
            for event in endpointer.score(endpointer.pause_id, scores[index], decisive):
                events.append((endpointer.now_ms, event))
    return events


def test_turn_with_candidate_then_commit() -> None:
    events = run([0.0] * 5 + [0.9] * 20 + [0.0] * 15)
    kinds = [e for _, e in events]
    assert kinds == [Event.SPEECH_STARTED, Event.SPEECH_STOPPED, Event.ENDPOINT_CANDIDATE, Event.END_OF_TURN]
    speech_end = 25 * 32
    assert events[1][0] == speech_end + 32  # the final decode starts at the first silent window
    candidate_at = events[2][0]
    commit_at = events[3][0]
    assert candidate_at - speech_end >= 150 and candidate_at - speech_end < 150 + 32
    assert commit_at - speech_end >= 300 and commit_at - speech_end < 300 + 32


def test_pause_shorter_than_hangover_resumes_the_same_turn() -> None:
    events = run([0.9] * 10 + [0.0] * 6 + [0.9] * 10 + [0.0] * 12)
    kinds = [e for _, e in events]
    assert kinds == [
        Event.SPEECH_STARTED,
        Event.SPEECH_STOPPED,
        Event.ENDPOINT_CANDIDATE,
        Event.SPEECH_RESUMED,
        Event.SPEECH_STOPPED,
        Event.ENDPOINT_CANDIDATE,
        Event.END_OF_TURN,
    ]


def test_blips_shorter_than_min_speech_do_not_open_a_turn() -> None:
    assert run([0.9, 0.9, 0.0, 0.0, 0.9, 0.0] * 10) == []


def test_grey_zone_keeps_the_current_state() -> None:
    # 0.4 sits between threshold-0.15 and threshold: speech continues, no candidate.
    events = run([0.9] * 10 + [0.4] * 20)
    assert [e for _, e in events] == [Event.SPEECH_STARTED]


def test_speech_start_is_backdated_to_the_first_speech_window() -> None:
    endpointer = Endpointer(EndpointingPolicy(min_speech_ms=96), window_ms=32)
    for p in [0.0] * 3 + [0.9] * 3:
        endpointer.push(p)
    assert endpointer.in_turn and endpointer.speech_start_ms == 96


def test_quiet_windows_end_speech_even_when_the_vad_lags() -> None:
    endpointer = Endpointer(FIXED, window_ms=32)
    for _ in range(10):
        endpointer.push(0.9)
    assert endpointer.push(0.8, quiet=True) == [Event.SPEECH_STOPPED]


def test_a_blip_inside_a_pause_does_not_restart_the_hangover() -> None:
    # spk2_snt1 has one 32 ms window of Silero wavering 100 ms after the sentence: it is pause, not speech.
    events = run([0.9] * 10 + [0.0] * 3 + [0.9] + [0.0] * 12)
    assert [e for _, e in events] == [
        Event.SPEECH_STARTED,
        Event.SPEECH_STOPPED,
        Event.ENDPOINT_CANDIDATE,
        Event.END_OF_TURN,
    ]
    speech_end = 10 * 32
    assert events[-1][0] == speech_end + 320  # the blip counted as pause: ten 32 ms windows >= 300 ms


def test_the_pause_clock_stops_while_speech_may_be_resuming() -> None:
    # spk1_snt1's "hurt ... the small dog": 224 ms of pause, then speech that takes 96 ms to confirm.
    events = run([0.9] * 10 + [0.0] * 7 + [0.9] * 10 + [0.0] * 12)
    kinds = [e for _, e in events]
    assert kinds.count(Event.END_OF_TURN) == 1 and kinds[-1] is Event.END_OF_TURN
    assert Event.SPEECH_RESUMED in kinds


# ---- the completeness score picks the hangover ------------------------------------------------------------
SEMANTIC = EndpointingPolicy(min_hangover_ms=64)  # candidate 32, short 64, fixed 288, long 1200


def commit_after_ms(scores: dict[int, float] | None, silence_windows: int = 60, decisive: bool = True) -> int | None:
    events = run([0.9] * 10 + [0.0] * silence_windows, SEMANTIC, scores, decisive)
    ends = [at for at, event in events if event is Event.END_OF_TURN]
    return ends[0] - 10 * 32 if ends else None


def test_a_pause_scored_complete_commits_after_the_short_hangover() -> None:
    # The score arrives at the third silent window (96 ms): the turn commits then (past the 64 ms minimum).
    assert commit_after_ms({12: 0.95}) == 96


def test_a_pause_scored_incomplete_waits_the_long_hangover() -> None:
    assert commit_after_ms({12: 0.05}) == pytest.approx(SEMANTIC.max_hangover_ms, abs=32)


def test_an_unsure_score_waits_in_between() -> None:
    waited = commit_after_ms({12: 0.62})
    assert waited is not None and SEMANTIC.min_hangover_ms < waited < SEMANTIC.max_hangover_ms


def test_the_transcripts_own_score_only_lengthens_the_fixed_hangover() -> None:
    # Whisper ends "The child almost hurt" with a full stop: that alone must not commit before 288 ms.
    assert commit_after_ms({12: 0.95}, decisive=False) == 288
    assert commit_after_ms({12: 0.05}, decisive=False) == pytest.approx(SEMANTIC.max_hangover_ms, abs=32)


def test_a_language_model_score_replaces_the_transcripts_and_is_not_replaced_by_it() -> None:
    endpointer = Endpointer(SEMANTIC, window_ms=32)
    for p in [0.9] * 10 + [0.0] * 2:
        endpointer.push(p)
    endpointer.score(endpointer.pause_id, 0.95)  # the transcript: full stop
    assert endpointer.hangover_ms == SEMANTIC.hangover_ms
    endpointer.score(endpointer.pause_id, 0.05, decisive=True)  # the language model: not finished
    assert endpointer.hangover_ms == SEMANTIC.max_hangover_ms
    endpointer.score(endpointer.pause_id, 0.95)  # a late transcript score changes nothing
    assert endpointer.hangover_ms == SEMANTIC.max_hangover_ms
    for p in [0.0] * 20:
        endpointer.push(p)
    assert endpointer.in_turn  # 700 ms of silence: still waiting


def test_by_default_a_complete_pause_waits_the_short_hangover_and_an_incomplete_one_longer() -> None:
    default = EndpointingPolicy()
    events = run([0.9] * 10 + [0.0] * 60, default, {5 + 10: lm_completeness(0.9)})
    assert [at for at, e in events if e is Event.END_OF_TURN] == [10 * 32 + 192]  # the score came at 192 ms
    events = run([0.9] * 10 + [0.0] * 60, default, {12: lm_completeness(0.004)})
    assert [at for at, e in events if e is Event.END_OF_TURN] == [10 * 32 + 1216]


def test_a_language_models_probability_maps_onto_the_completeness_scale() -> None:
    probabilities = (0.9, LM_COMPLETE_AT, 0.4, 0.3, 0.25, LM_INCOMPLETE_AT, 0.01)
    waits = [EndpointingPolicy().hangover_for(lm_completeness(p)) for p in probabilities]
    assert waits == sorted(waits)
    assert waits[0] == waits[1] == EndpointingPolicy().min_hangover_ms
    assert waits[-2] == waits[-1] == EndpointingPolicy().max_hangover_ms
    assert waits[1] < waits[2] < waits[3] < waits[4] < waits[5]
    # A clause end the model half expects to go on ("...against the wizard |", P 0.29) outwaits a 600 ms pause.
    assert EndpointingPolicy().hangover_for(lm_completeness(0.29)) > 600


def test_the_embedded_models_calibration_leaves_its_scores_as_they_are() -> None:
    for p in (0.0, 0.01, LM_INCOMPLETE_AT, 0.29, 0.4, LM_COMPLETE_AT, 0.7, 1.0):
        assert TurnEndCalibration().standard(p) == pytest.approx(p)


def test_another_models_scores_go_onto_the_embedded_models_scale() -> None:
    """A model that scores everything higher (finished from 0.9, unfinished up to 0.5): its points land on 0.45 and
    0.2, so its scores wait as long as the embedded model's would for the same judgement."""
    sure = TurnEndCalibration(complete_at=0.9, incomplete_at=0.5)
    assert sure.standard(0.9) == pytest.approx(LM_COMPLETE_AT) and sure.standard(0.5) == pytest.approx(LM_INCOMPLETE_AT)
    assert sure.standard(0.0) == 0.0 and sure.standard(1.0) == 1.0
    assert sure.standard(-0.5) == 0.0 and sure.standard(1.5) == 1.0  # a model's rounding past the ends
    points = [i / 100 for i in range(101)]
    mapped = [sure.standard(p) for p in points]
    assert mapped == sorted(mapped), "the order of scores is kept"
    # What Gemma scores 0.46 (the short wait), this model scores ~0.92; its own 0.46 is a long wait.
    policy = EndpointingPolicy()
    assert policy.hangover_for(lm_completeness(sure.standard(0.92))) == policy.min_hangover_ms
    assert policy.hangover_for(lm_completeness(sure.standard(0.46))) == policy.max_hangover_ms


@pytest.mark.parametrize(("complete_at", "incomplete_at"), [(0.3, 0.4), (0.5, 0.5), (1.0, 0.2), (0.45, 0.0)])
def test_a_calibration_whose_points_are_out_of_order_is_refused_saying_what_to_send(
    complete_at: float, incomplete_at: float
) -> None:
    with pytest.raises(ValueError, match="0 < incomplete_at < complete_at < 1"):
        TurnEndCalibration(complete_at, incomplete_at)


def test_an_llm_replica_with_a_bad_calibration_stops_before_it_loads_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.llm import server as llm_server

    def no_engine(settings: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_server, "build_engine", no_engine)
    settings = llm_server.LlmSettings(turn_end_complete_at=0.3, turn_end_incomplete_at=0.4)
    with pytest.raises(SystemExit, match=re.escape("llm: turn_end_incomplete_at=0.4 and turn_end_complete_at=0.3")):
        llm_server.build_server(settings)


def test_a_calibrations_operating_point_counts_waits_and_inside_commits() -> None:
    from services.llm.turn_end import operating_point

    policy = EndpointingPolicy()
    finished, inside = [0.9, 0.5, 0.3], [0.0, 0.01, 0.46, 0.35]
    default = operating_point(finished, inside, TurnEndCalibration(), policy)
    assert default["finished_wait_ms_p50"] == policy.min_hangover_ms  # 0.5: the short wait
    assert default["finished_at_min_hangover"] == round(2 / 3, 3)
    assert default["inside_within_200ms"] == 0.25  # 0.46 commits at once
    assert default["inside_within_600ms"] == 0.5  # 0.35 waits ~520 ms
    stricter = operating_point(finished, inside, TurnEndCalibration(0.6, 0.3), policy)
    assert stricter["inside_within_600ms"] == 0.25 and stricter["finished_at_min_hangover"] == round(1 / 3, 3)


def test_a_score_that_never_comes_leaves_the_fixed_hangover() -> None:
    assert commit_after_ms(None) == pytest.approx(SEMANTIC.hangover_ms, abs=32)


def test_a_late_score_cannot_reopen_a_committed_turn() -> None:
    endpointer = Endpointer(SEMANTIC, window_ms=32)
    for p in [0.9] * 10 + [0.0] * 12:  # 384 ms of silence: the fixed hangover committed it
        endpointer.push(p)
    assert not endpointer.in_turn
    assert endpointer.score(endpointer.pause_id, 0.0) == []


def test_a_score_of_an_earlier_pause_is_ignored() -> None:
    endpointer = Endpointer(SEMANTIC, window_ms=32)
    for p in [0.9] * 10 + [0.0] * 2:
        endpointer.push(p)
    stale = endpointer.pause_id
    for p in [0.9] * 5 + [0.0] * 2:  # speech resumed, a new pause began
        endpointer.push(p)
    assert endpointer.score(stale, 1.0) == [] and endpointer.in_turn


def test_policy_ranges_are_checked_in_one_place() -> None:
    assert policy_from(asr_pb2.EndpointingConfig()) == EndpointingPolicy()
    assert policy_from(to_proto(FIXED)) == FIXED
    with pytest.raises(RequestError, match="min_hangover_ms <= hangover_ms"):
        policy_from(asr_pb2.EndpointingConfig(hangover_ms=2000))
    with pytest.raises(RequestError, match=r"vad_threshold=1\.5 out of range"):
        policy_from(asr_pb2.EndpointingConfig(vad_threshold=1.5))
    with pytest.raises(RequestError, match="hangover_ms=20000 out of range"):
        policy_from(asr_pb2.EndpointingConfig(hangover_ms=20000, fixed_hangover=True))
