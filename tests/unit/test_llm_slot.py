"""The llama.cpp engine's slot, without a model: earliest deadline first between new calls (due on arrival) and
replies that gave their slot up (due before their audio runs dry)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.llm.llama_common import MIN_AHEAD_S, REFILL_S, RESUME_AT, SpeechClock, past_urgent, speech_s
from services.llm.llama_cpp_engine import NEW_CALL_DUE_S, LlamaCppEngine, _Slot


def one_slot(max_ahead_s: float = 0.0) -> tuple[LlamaCppEngine, _Slot]:
    engine = LlamaCppEngine(Path("not-loaded.gguf"), max_ahead_s=max_ahead_s)
    engine._slots = [_Slot(llama=None, index=0)]  # type: ignore[arg-type]  # the slot logic never touches it
    return engine, engine._slots[0]


async def test_the_slot_goes_to_the_earliest_deadline_and_a_new_call_is_due_soon_after_it_arrives() -> None:
    engine, slot = one_slot()
    assert await engine._acquire("running") is slot
    now = time.monotonic()
    deadlines = {"new": None, "ahead": now + 2.0, "soon": now + NEW_CALL_DUE_S / 2, "dry": now - 0.1}
    order: list[str] = []
    for name, deadline in deadlines.items():  # the new call first in line: due at now + NEW_CALL_DUE_S
        call = asyncio.ensure_future(engine._acquire(name, deadline))
        call.add_done_callback(lambda _, name=name: order.append(name))  # type: ignore[misc]
    await asyncio.sleep(0)
    assert engine.waiting == 4 and engine._earliest_waiting == pytest.approx(now - 0.1)
    for _ in deadlines:
        engine._release(slot)  # each gets the slot in turn
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # the last one's callback
    assert order == ["dry", "soon", "new", "ahead"], "a reply about to run dry goes before a new turn's first words"
    engine._release(slot)
    assert not slot.busy and engine._earliest_waiting == float("inf")


async def test_a_waiter_that_gives_up_leaves_the_line_and_its_deadline_with_it() -> None:
    engine, slot = one_slot()
    await engine._acquire("running")
    now = time.monotonic()
    urgent = asyncio.ensure_future(engine._acquire("gives-up", deadline=now - 1.0))
    later = asyncio.ensure_future(engine._acquire("stays", deadline=now + 1.0))
    await asyncio.sleep(0)
    urgent.cancel()
    with pytest.raises(asyncio.CancelledError):
        await urgent
    assert engine._earliest_waiting == pytest.approx(now + 1.0), "a running reply no longer yields to it"
    engine._release(slot)
    assert await later is slot


def test_a_reply_is_due_again_before_the_audio_of_what_it_streamed_runs_dry() -> None:
    playout = SpeechClock(started=100.0, text="I am sure that ")
    assert playout.deadline("one war") == pytest.approx(100.0 + speech_s("I am sure that one war") - REFILL_S)
    assert speech_s("x" * 15) == pytest.approx(1.0), "about 150 words a minute"


@pytest.mark.parametrize(
    ("said", "urgent_words", "past"),
    [("", 0, False), ("That", 0, True), ("That is", 2, False), ("That is a", 2, True), (" ", 0, False)],
)
def test_a_reply_keeps_its_slot_until_its_urgent_words_are_out(said: str, urgent_words: int, past: bool) -> None:
    assert past_urgent(said, urgent_words) is past


async def test_a_reply_held_back_for_running_ahead_queues_again_only_once_its_playout_has_caught_up() -> None:
    engine, slot = one_slot(max_ahead_s=MIN_AHEAD_S)
    await engine._acquire("other")  # someone holds the slot meanwhile
    # Streamed 0.8 s more than RESUME_AT of max_ahead_s ahead of its listener: it waits that long, out of line.
    playout = SpeechClock(started=time.monotonic(), text="x" * round(15 * (RESUME_AT * MIN_AHEAD_S + 0.8)))
    back = asyncio.ensure_future(engine._reacquire("held", playout))
    await asyncio.sleep(0.1)
    assert engine.waiting == 0, "held back: not in line while it is far enough ahead"
    await asyncio.sleep(1.0)
    assert engine.waiting == 1 and engine._earliest_waiting == pytest.approx(playout.deadline())
    engine._release(slot)
    assert await back is slot


async def test_without_flow_control_a_reply_that_gave_its_slot_up_queues_again_at_once() -> None:
    engine, slot = one_slot()
    await engine._acquire("other")
    back = asyncio.ensure_future(engine._reacquire("held", SpeechClock(started=time.monotonic(), text="x" * 90)))
    await asyncio.sleep(0)
    assert engine.waiting == 1
    engine._release(slot)
    assert await back is slot


@pytest.mark.parametrize("max_ahead_s", [-1.0, 0.5, MIN_AHEAD_S - 0.1])
def test_a_flow_control_limit_that_leaves_no_time_to_refill_is_refused(max_ahead_s: float) -> None:
    with pytest.raises(ValueError, match="max_ahead_s"):
        LlamaCppEngine(Path("not-loaded.gguf"), max_ahead_s=max_ahead_s)


def test_how_far_ahead_a_reply_is_counts_what_it_streamed_less_what_has_played() -> None:
    assert SpeechClock().ahead_s("anything") == 0.0, "nothing plays before its urgent words are out"
    playout = SpeechClock(started=time.monotonic() - 1.0, text="x" * 30)
    assert playout.ahead_s("y" * 15) == pytest.approx(2.0, abs=0.05)
