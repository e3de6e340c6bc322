"""The reply pacer: a lead then real time, pause and resume where it left off, flush at once; on a fake clock
(`take`) and on the event loop's (`run`)."""

from __future__ import annotations

import asyncio
import time

from gateway.playout import Playout

FRAME_S = 0.25  # a binary fraction, so the fake clock's sums are exact


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def playout(lead_frames: int = 5) -> tuple[Playout[int], FakeClock, list[int]]:
    clock = FakeClock()
    played: list[int] = []
    return Playout(lambda frame, sent_us: played.append(frame), FRAME_S, lead_frames, clock), clock, played


def take_due(pacer: Playout[int]) -> list[int]:
    """Every frame due now."""
    frames = []
    while (frame := pacer.take()) is not None:
        frames.append(frame)
    return frames


def test_the_frame_due_now_and_the_lead_leave_at_once_then_one_per_frame_time() -> None:
    pacer, clock, played = playout(lead_frames=5)
    for index in range(12):
        pacer.push(index)
    assert take_due(pacer) == [0, 1, 2, 3, 4, 5]
    assert pacer.wait_s() == FRAME_S
    clock.now_s += FRAME_S / 2
    assert take_due(pacer) == [] and pacer.wait_s() == FRAME_S / 2
    clock.now_s += FRAME_S / 2
    assert take_due(pacer) == [6]
    clock.now_s += 5 * FRAME_S
    assert take_due(pacer) == [7, 8, 9, 10, 11]
    assert played == list(range(12)), "every frame that left was reported, in order"
    assert pacer.queued == 0 and pacer.wait_s() is None


def test_a_consumer_that_falls_behind_gets_at_most_the_lead_at_once() -> None:
    pacer, clock, _ = playout(lead_frames=2)
    for index in range(20):
        pacer.push(index)
    assert take_due(pacer) == [0, 1, 2]
    clock.now_s += 50 * FRAME_S  # the sender was stuck
    assert take_due(pacer) == [3, 4, 5], "no burst beyond the lead"


def test_a_frame_that_arrives_after_the_queue_ran_dry_leaves_at_once() -> None:
    pacer, clock, _ = playout(lead_frames=0)
    pacer.push(0)
    assert take_due(pacer) == [0]
    clock.now_s += 10 * FRAME_S
    pacer.push(1)
    assert take_due(pacer) == [1]


def test_audio_that_comes_after_the_listener_ran_dry_is_a_gap_heard_and_counted_until_the_flush() -> None:
    pacer, clock, _ = playout(lead_frames=2)
    for index in range(3):
        pacer.push(index)
    assert take_due(pacer) == [0, 1, 2]
    clock.now_s += 2 * FRAME_S  # the listener still has the lead's worth
    pacer.push(3)
    assert take_due(pacer) == [3] and pacer.gap_s == 0
    clock.now_s = 102.0  # it had audio until 101.0 (frame 3 was due at 100.25 + the lead)
    pacer.push(4)
    assert take_due(pacer) == [4] and pacer.gap_s == 1.0
    pacer.pause()
    clock.now_s += 10.0
    pacer.resume()
    pacer.push(5)
    assert take_due(pacer) == [5] and pacer.gap_s == 1.0, "a pause is not a gap: the reply was held on purpose"
    pacer.flush()
    assert pacer.gap_s == 0, "the next reply counts its own"


def test_how_far_ahead_of_the_listener_more_of_the_reply_came_is_its_tightest_margin_until_the_flush() -> None:
    pacer, clock, _ = playout(lead_frames=2)
    for index in range(3):
        pacer.push(index)
    assert take_due(pacer) == [0, 1, 2] and pacer.ahead_min_s is None, "the reply's first audio is not 'more'"
    clock.now_s = 100.5  # frame 3 is due to leave at 100.25, so the listener has audio until 100.75
    pacer.push(3, more=True)
    pacer.push(4)
    assert pacer.ahead_min_s == 0.25
    assert take_due(pacer) == [3, 4]
    clock.now_s = 100.75
    pacer.push(5, more=True)  # 3 and 4 play out at 100.75 .. 101.25
    assert pacer.ahead_min_s == 0.25, "the tightest margin stays"
    clock.now_s = 103.0  # frames up to 5 played out by 101.5: 1.5 s late
    pacer.push(6, more=True)
    assert pacer.ahead_min_s == -1.5
    pacer.flush()
    assert pacer.ahead_min_s is None, "the next reply measures its own"


def test_a_pause_holds_the_frames_and_the_resume_plays_on_from_where_it_paused_with_a_lead() -> None:
    pacer, clock, played = playout(lead_frames=2)
    for index in range(10):
        pacer.push(index)
    assert take_due(pacer) == [0, 1, 2]
    pacer.pause()
    clock.now_s += 50 * FRAME_S
    assert pacer.paused and take_due(pacer) == [] and pacer.wait_s() is None
    assert pacer.queued == 7, "held, not dropped"
    pacer.resume()
    assert take_due(pacer) == [3, 4, 5], "the listener's buffer ran dry: a lead again"
    clock.now_s += FRAME_S
    assert take_due(pacer) == [6]
    assert played == list(range(7))


def test_a_flush_drops_what_is_queued_ends_a_pause_and_the_next_reply_starts_with_a_lead() -> None:
    pacer, _, played = playout(lead_frames=1)
    for index in range(10):
        pacer.push(index)
    assert take_due(pacer) == [0, 1]
    pacer.pause()
    assert pacer.flush() == 8
    assert pacer.queued == 0 and not pacer.paused
    pacer.push(100)
    pacer.push(101)
    pacer.push(102)
    assert take_due(pacer) == [100, 101]
    assert played == [0, 1, 100, 101], "dropped frames were never reported as played"


async def test_run_sends_at_real_time_and_reports_each_frame_after_sending_it() -> None:
    events: list[tuple[str, int]] = []
    sent_at: list[float] = []

    async def send(frame: int, sent_us: int) -> None:
        events.append(("sent", frame))
        sent_at.append(time.monotonic())

    pacer: Playout[int] = Playout(lambda frame, sent_us: events.append(("played", frame)), 0.05, 1)
    runner = pacer.start(send)
    try:
        for index in range(6):
            pacer.push(index)
        while len(sent_at) < 6:
            await asyncio.sleep(0.01)
    finally:
        runner.cancel()
    assert events == [(kind, i) for i in range(6) for kind in ("sent", "played")]
    assert sent_at[1] - sent_at[0] < 0.04, "the lead leaves at once"
    paced_s = sent_at[5] - sent_at[1]
    assert 0.18 <= paced_s < 0.5, f"four frames of 50 ms took {paced_s:.3f} s"


async def test_run_wakes_for_new_frames_and_stops_within_a_frame_on_pause_and_flush() -> None:
    sent: list[int] = []

    async def send(frame: int, sent_us: int) -> None:
        sent.append(frame)

    pacer: Playout[int] = Playout(lambda frame, sent_us: None, 0.05, 0)
    runner = pacer.start(send)
    try:
        await asyncio.sleep(0.02)  # idle: waiting for frames
        for index in range(100):
            pacer.push(index)
        while len(sent) < 2:
            await asyncio.sleep(0.005)
        pacer.pause()
        count = len(sent)
        await asyncio.sleep(0.15)
        assert len(sent) == count, "nothing leaves while paused"
        pacer.resume()
        while len(sent) < count + 2:
            await asyncio.sleep(0.005)
        assert sent == list(range(len(sent))), "resumed where it paused"
        pacer.flush()
        count = len(sent)
        await asyncio.sleep(0.15)
        assert len(sent) == count, "nothing leaves after a flush"
        pacer.push(500)
        while sent[-1] != 500:
            await asyncio.sleep(0.005)
    finally:
        runner.cancel()


def test_the_audio_the_listener_has_left_counts_the_lead_and_the_queue_and_is_unknown_when_nothing_plays() -> None:
    pacer, clock, _ = playout(lead_frames=2)
    assert pacer.ahead_s() is None, "no reply has started"
    for index in range(6):
        pacer.push(index)
    assert pacer.ahead_s() is None, "queued is not playing"
    assert take_due(pacer) == [0, 1, 2]  # frame 0 is due now; the lead (1, 2) is in the listener's buffer
    assert pacer.ahead_s() == 6 * FRAME_S, "three frames sent ahead, and three queued"
    clock.now_s += 2 * FRAME_S
    assert take_due(pacer) == [3, 4] and pacer.ahead_s() == 4 * FRAME_S
    pacer.pause()
    assert pacer.ahead_s() is None, "paused: the listener's audio is not running out"
    pacer.resume()
    take_due(pacer)
    clock.now_s += 10 * FRAME_S
    assert pacer.ahead_s() is not None and pacer.ahead_s() < 0, "run dry: negative, how long ago"
