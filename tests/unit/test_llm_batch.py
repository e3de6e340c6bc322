"""The batched llama.cpp engine's pure parts: sampling as llama-cpp-python does it, stop strings held back, and
which replies go into a step."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import numpy as np
import pytest

from services.llm.engine import GenerationRequest, Message
from services.llm.llama_batch_engine import (
    N_BATCH,
    _held_back,
    _Reply,
    plan_step,
    prefill_skipped,
    prefills_in_the_way,
    ready_at,
    sample,
)
from services.llm.llama_common import PREFILL_STEP_TOKENS, SpeechClock
from services.llm.server import LlmSettings, build_engine

VOCAB = 1000


def _logits(**values: float) -> np.ndarray:
    logits = np.full(VOCAB, -5.0, dtype=np.float32)
    for name, value in values.items():
        logits[int(name[1:])] = value
    return logits


def test_greedy_takes_the_top_logit() -> None:
    assert sample(_logits(t7=3.0, t9=2.0), [], 0.0, 0.95, np.random.default_rng(0)) == 7


def test_the_repeat_penalty_divides_a_positive_logit_and_multiplies_a_negative_one() -> None:
    rng = np.random.default_rng(0)
    assert sample(_logits(t1=1.05, t2=1.0), [1], 0.0, 0.95, rng) == 2, "1.05 / 1.1 < 1.0"
    assert sample(_logits(t1=1.05, t2=1.0), [], 0.0, 0.95, rng) == 1
    negative = np.full(VOCAB, -9.0, dtype=np.float32)
    negative[1], negative[2] = -1.0, -1.05
    assert sample(negative, [1], 0.0, 0.95, rng) == 2, "-1.0 x 1.1 < -1.05"


def test_a_token_repeated_is_penalized_once_not_per_repeat() -> None:
    rng = np.random.default_rng(0)
    assert sample(_logits(t1=1.2, t2=1.0), [1, 1, 1, 1], 0.0, 0.95, rng) == 1, "1.2 / 1.1 > 1.0; 1.2 / 1.1^4 < 1.0"


def test_sampling_draws_only_from_the_top_tokens_and_a_seed_repeats_it() -> None:
    logits = np.linspace(0.0, 8.0, VOCAB).astype(np.float32)  # every token possible, the last ones likeliest
    draws = [sample(logits, [], 1.0, 0.95, np.random.default_rng(seed)) for seed in range(300)]
    assert min(draws) >= VOCAB - 40, "top-k 40"
    assert len(set(draws)) > 5, "a draw, not the argmax"
    assert draws == [sample(logits, [], 1.0, 0.95, np.random.default_rng(seed)) for seed in range(300)]
    peaked = _logits(t3=10.0, t4=7.5)  # token 4 has p ~ 0.08 of token 3's: above min-p 0.05; the rest far below
    assert {sample(peaked, [], 1.0, 1.0, np.random.default_rng(seed)) for seed in range(200)} == {3, 4}


@pytest.mark.parametrize(
    ("text", "held"),
    [("Hello", 0), ("Hello U", 1), ("Hello Use", 3), ("Hello Assistant", 9), ("Hello Us.", 0), ("", 0)],
)
def test_text_that_could_begin_a_stop_string_waits_for_the_next_token(text: str, held: int) -> None:
    assert _held_back(text, ("\n", "User:", "Assistant:")) == held


def _reply(loop: asyncio.AbstractEventLoop, prompt: int, pending: int, started: float | None, said: str = "") -> _Reply:
    request = GenerationRequest("s", [Message("user", "hi")])
    reply = _Reply(request, list(range(prompt)), None, ("\n",), loop, asyncio.Queue())
    reply.position = prompt - pending if pending > 1 else prompt
    reply.pending = list(range(pending))
    reply.playout = SpeechClock(started=started)
    reply.text = said
    return reply


async def test_a_step_with_urgent_work_leaves_out_replies_far_ahead_of_their_listener() -> None:
    loop = asyncio.get_running_loop()
    now = time.monotonic()
    new = _reply(loop, prompt=130, pending=40, started=None)
    ahead = _reply(loop, prompt=120, pending=1, started=now, said="x" * 60)  # 4 s of speech streamed
    due = _reply(loop, prompt=120, pending=1, started=now - 3.9, said="x" * 60)  # runs dry in 0.1 s
    first_words = _reply(loop, prompt=120, pending=1, started=None, said="It")  # its listener still waits
    plan = dict(plan_step([ahead, due, new, first_words], now, due_s=1.0))
    assert plan == {new: 40, first_words: 1, due: 1}
    assert dict(plan_step([ahead, due, new, first_words], now, due_s=4.5)) == {
        new: 40,
        first_words: 1,
        due: 1,
        ahead: 1,
    }
    assert plan_step([ahead, due], now, due_s=1.0) == [(ahead, 1), (due, 1)], "nothing urgent: all go"
    assert len(plan_step([ahead, due, new], now, due_s=None)) == 3, "never sitting out: all go"


async def test_flow_control_holds_a_reply_far_enough_ahead_of_its_listener_even_with_nothing_urgent() -> None:
    loop = asyncio.get_running_loop()
    now = time.monotonic()
    ahead = _reply(loop, prompt=120, pending=1, started=now, said="x" * 60)  # 4 s of speech streamed
    close = _reply(loop, prompt=120, pending=1, started=now - 2, said="x" * 60)  # 2 s left
    first_words = _reply(loop, prompt=120, pending=1, started=None, said="It")
    assert plan_step([ahead, close, first_words], now, due_s=None, max_ahead_s=3.0) == [(first_words, 1), (close, 1)]
    assert plan_step([ahead], now, due_s=None, max_ahead_s=3.0) == [], "alone, and still 4 s ahead: it waits"
    assert plan_step([ahead], now + 1.5, due_s=None, max_ahead_s=3.0) == [(ahead, 1)], "its listener caught up"
    assert plan_step([ahead, close], now, due_s=None) == [(ahead, 1), (close, 1)], "0: no limit"


async def test_a_reply_whose_first_words_just_went_out_steps_aside_while_the_tts_synthesizes_them() -> None:
    loop = asyncio.get_running_loop()
    now = time.monotonic()
    just_out = _reply(loop, prompt=120, pending=1, started=now - 0.01, said="That is a")
    earlier = _reply(loop, prompt=120, pending=1, started=now - 0.2, said="x" * 30)
    first_words = _reply(loop, prompt=120, pending=1, started=None, said="It")
    plan = plan_step([just_out, earlier, first_words], now, due_s=None, yield_s=0.05)
    assert plan == [(first_words, 1), (earlier, 1)], "the others' steps go on"
    assert plan_step([just_out], now + 0.035, due_s=None, yield_s=0.05) == [], "alone, it still waits"
    assert plan_step([just_out], now, due_s=None, yield_s=0.0) == [(just_out, 1)], "0: no pause"
    assert plan_step([just_out], now + 0.041, due_s=None, yield_s=0.05) == [(just_out, 1)], "then it goes on"
    assert ready_at(just_out, 0.05, 0.0) == pytest.approx(now + 0.04)
    far = _reply(loop, prompt=120, pending=1, started=now, said="x" * 60)  # 4 s of speech streamed
    assert ready_at(far, 0.05, 3.0) == pytest.approx(now + 1.0), "flow control, the later of the two"


async def test_prompts_share_the_step_budget_and_carry_on_in_the_next() -> None:
    loop = asyncio.get_running_loop()
    big = _reply(loop, prompt=700, pending=700, started=None)
    small = _reply(loop, prompt=130, pending=20, started=None)
    big.enqueued_ns, small.enqueued_ns = 1, 2
    assert plan_step([small, big], time.monotonic()) == [(big, N_BATCH)], "in arrival order"
    big.pending = big.pending[N_BATCH:]
    assert plan_step([small, big], time.monotonic()) == [(big, 700 - N_BATCH), (small, 20)]


async def test_a_prefill_sits_out_steps_with_urgent_work_and_goes_in_short_steps() -> None:
    loop = asyncio.get_running_loop()
    now = time.monotonic()
    prefill = _reply(loop, prompt=200, pending=80, started=None)
    prefill.prefill = True
    assert not prefill.urgent, "nobody waits on a prefill"
    continuing = _reply(loop, prompt=120, pending=1, started=now - 1, said="x" * 60)
    first_words = _reply(loop, prompt=120, pending=1, started=None, said="It")
    assert plan_step([prefill, first_words], now) == [(first_words, 1)]
    assert dict(plan_step([prefill, continuing], now)) == {continuing: 1, prefill: PREFILL_STEP_TOKENS}
    prefill.pending = prefill.pending[: PREFILL_STEP_TOKENS // 2]
    assert plan_step([prefill], now) == [(prefill, PREFILL_STEP_TOKENS // 2)]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_batch": 0}, "max_batch=0 out of range; use 1-64"),
        ({"max_batch": 65}, "max_batch=65 out of range"),
        ({"continuation_due_s": 0.0}, "continuation_due_s=0 must be above 0"),
        ({"max_batch": 4, "slots": 2}, "leave slots at 1"),
        ({"max_batch": 4, "max_ahead_s": 1.0}, "max_ahead_s=1 leaves no time to refill"),
        ({"first_chunk_yield_ms": -1.0}, "first_chunk_yield_ms=-1 out of range; use 0-500"),
        ({"max_batch": 1, "first_chunk_yield_ms": 800.0}, "first_chunk_yield_ms=800 out of range; use 0-500"),
    ],
)
def test_a_bad_batch_setting_stops_the_server_with_a_reason(fields: dict[str, object], words: str) -> None:
    settings = dataclasses.replace(LlmSettings(), model_path="/nowhere/model.gguf", **fields)
    with pytest.raises(SystemExit, match=words):
        build_engine(settings)


def _call(loop: asyncio.AbstractEventLoop, session: str, prefill: bool = False, at: int = 0) -> _Reply:
    call = _Reply(GenerationRequest(session, [Message("user", "hi")]), [1, 2], None, (), loop, asyncio.Queue())
    call.prefill, call.enqueued_ns = prefill, at
    return call


async def test_a_waiting_reply_ends_its_own_sessions_prefill_and_only_as_many_others_as_it_needs_sequences() -> None:
    loop = asyncio.get_running_loop()
    old, new = _call(loop, "a", prefill=True, at=1), _call(loop, "b", prefill=True, at=2)
    serving = _call(loop, "c")
    active = [old, new, serving]
    assert prefills_in_the_way(collections.deque(), active, 3, beside=True) == [], "no reply waits: none ends"
    assert prefills_in_the_way(collections.deque([_call(loop, "b")]), active, 3, beside=True) == [new]
    assert prefills_in_the_way(collections.deque([_call(loop, "d")]), active, 3, beside=True) == [old], "oldest"
    assert prefills_in_the_way(collections.deque([_call(loop, "d")]), active, 4, beside=True) == [], "one is free"
    waiting = collections.deque([_call(loop, "d"), _call(loop, "e", prefill=True)])
    assert prefills_in_the_way(waiting, active, 4, beside=False) == [waiting[1], old, new], "idle only: all end"


async def test_a_prefill_is_skipped_while_a_reply_waits_no_sequence_is_free_or_its_session_is_served() -> None:
    loop = asyncio.get_running_loop()
    serving = [_call(loop, "a")]
    assert not prefill_skipped("b", collections.deque(), serving, 2, beside=True)
    assert prefill_skipped("a", collections.deque(), serving, 2, beside=True), "its own session is served"
    assert prefill_skipped("b", collections.deque(), serving, 1, beside=True), "no sequence free"
    assert prefill_skipped("b", collections.deque([_call(loop, "c")]), serving, 2, beside=True), "a reply waits"
    assert prefill_skipped("b", collections.deque(), serving, 2, beside=False), "idle only"
    assert not prefill_skipped("b", collections.deque(), [], 2, beside=False)
