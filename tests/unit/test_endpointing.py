from services.asr.endpointing import Endpointer, EndpointingPolicy, Event


def run(probabilities: list[float], policy: EndpointingPolicy | None = None) -> list[tuple[int, Event]]:
    endpointer = Endpointer(policy or EndpointingPolicy(), window_ms=32)
    events = []
    for p in probabilities:
        event = endpointer.push(p)
        if event:
            events.append((endpointer.now_ms, event))
    return events


def test_turn_with_candidate_then_commit() -> None:
    events = run([0.0] * 5 + [0.9] * 20 + [0.0] * 15)
    kinds = [e for _, e in events]
    assert kinds == [Event.SPEECH_STARTED, Event.SILENCE_STARTED, Event.ENDPOINT_CANDIDATE, Event.END_OF_TURN]
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
        Event.SILENCE_STARTED,
        Event.ENDPOINT_CANDIDATE,
        Event.SPEECH_RESUMED,
        Event.SILENCE_STARTED,
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
    endpointer = Endpointer(EndpointingPolicy(), window_ms=32)
    for _ in range(10):
        endpointer.push(0.9)
    assert endpointer.push(0.8, quiet=True) is Event.SILENCE_STARTED


def test_a_blip_inside_a_pause_does_not_restart_the_hangover() -> None:
    # spk2_snt1 has one 32 ms window of Silero wavering 100 ms after the sentence: it is pause, not speech.
    endpointer = Endpointer(EndpointingPolicy(), window_ms=32)
    events = []
    for p in [0.9] * 10 + [0.0] * 3 + [0.9] + [0.0] * 12:
        event = endpointer.push(p)
        if event:
            events.append((endpointer.now_ms, event))
    assert [e for _, e in events] == [
        Event.SPEECH_STARTED,
        Event.SILENCE_STARTED,
        Event.ENDPOINT_CANDIDATE,
        Event.END_OF_TURN,
    ]
    speech_end = 10 * 32
    assert events[-1][0] == speech_end + 320  # the blip counted as pause: ten 32 ms windows >= 300 ms
    assert endpointer.speech_end_ms == speech_end


def test_the_pause_clock_stops_while_speech_may_be_resuming() -> None:
    # spk1_snt1's "hurt ... the small dog": 224 ms of pause, then speech that takes 96 ms to confirm.
    events = run([0.9] * 10 + [0.0] * 7 + [0.9] * 10 + [0.0] * 12)
    kinds = [e for _, e in events]
    assert kinds.count(Event.END_OF_TURN) == 1 and kinds[-1] is Event.END_OF_TURN
    assert Event.SPEECH_RESUMED in kinds
