"""The batched llama.cpp engine in process, on the real Gemma 3 270M: several replies in one decode per step, each
session's prefix kept, urgent work first, cancellation within a step."""

from __future__ import annotations

import asyncio
import threading
import time

import llama_cpp
import pytest
import pytest_asyncio

from services.llm.engine import GenerationChunk, GenerationRequest, Message
from services.llm.llama_batch_engine import LlamaBatchEngine, SavedSequence
from services.llm.llama_common import MIN_AHEAD_S, default_model_path, past_urgent, speech_s

pytestmark = pytest.mark.integration

MAX_BATCH = 3
LONG = "Say the alphabet."
LONG_START = "A, B, C, D, E,"  # a reply of ~45 tokens, once begun
YIELD_S = 0.3  # far longer than a step, so the pause stands out


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines():
    engines = {
        # Sitting out from 0.5 s before running dry: a reply 40 characters (2.7 s of speech) in is surely past it.
        "urgent_first": LlamaBatchEngine(default_model_path(), max_batch=MAX_BATCH, continuation_due_s=0.5),
        "every_step": LlamaBatchEngine(default_model_path(), max_batch=MAX_BATCH, prioritize=False),
        "paced": LlamaBatchEngine(default_model_path(), max_batch=MAX_BATCH, max_ahead_s=MIN_AHEAD_S),
        "stepping_aside": LlamaBatchEngine(default_model_path(), max_batch=MAX_BATCH, first_chunk_yield_s=YIELD_S),
        "beside": LlamaBatchEngine(
            default_model_path(), max_batch=MAX_BATCH, continuation_due_s=0.5, prefill_beside_replies=True
        ),
    }
    for engine in engines.values():
        await engine.start()
    yield engines
    for engine in engines.values():
        await engine.close()


async def _chunks(engine: LlamaBatchEngine, session: str, text: str, **fields: object) -> list[GenerationChunk]:
    request = GenerationRequest(session, [Message("user", text)], max_tokens=48, **fields)  # type: ignore[arg-type]
    return [chunk async for chunk in engine.generate(request)]


def _text(chunks: list[GenerationChunk]) -> str:
    return "".join(chunk.text for chunk in chunks)


async def _admitted(engine: LlamaBatchEngine) -> None:
    """Until no call made before this one waits for a sequence."""
    await asyncio.sleep(0.01)  # calls just made (ensure_future) are under way
    while engine.waiting:
        await asyncio.sleep(0.005)


def _follow_up(first: list[GenerationChunk]) -> list[Message]:
    """The dialogue after the reply `first` to "What is the capital of France?", one more question on."""
    return [
        Message("user", "What is the capital of France?"),
        Message("assistant", _text(first)),
        Message("user", "And of Spain?"),
    ]


async def test_replies_in_flight_share_each_decode_step(engines) -> None:
    engine = engines["urgent_first"]
    questions = ["What is the capital of France?", "How long does it take to boil an egg?", LONG]
    steps = engine.steps
    replies = await asyncio.gather(*(_chunks(engine, f"share-{i}", q) for i, q in enumerate(questions)))
    for chunks in replies:
        assert _text(chunks).strip(), chunks
        assert chunks[-1].finish_reason in ("stop", "length")
        assert "\n" not in _text(chunks) and "User:" not in _text(chunks), "the stop strings end a reply"
    tokens = sum(chunks[-1].completion_tokens for chunks in replies)
    assert engine.steps - steps < tokens, "several replies' tokens in one decode call"
    assert " " in _text(replies[0]), "words keep their spaces (a piece carries its leading one)"


async def test_a_follow_up_turn_prefills_only_its_new_tokens(engines) -> None:
    engine = engines["urgent_first"]
    first = await _chunks(engine, "follow", "What is the capital of France?")
    dialogue = _follow_up(first)
    second = [c async for c in engine.generate(GenerationRequest("follow", dialogue, max_tokens=16))]
    assert second[-1].cached_prompt_tokens > first[-1].prompt_tokens, (first[-1], second[-1])


PARTIAL = "Can you tell me what the weather will"
WHOLE = "Can you tell me what the weather will be like tomorrow?"


async def test_a_prefill_of_the_words_so_far_leaves_the_reply_only_the_rest(engines) -> None:
    engine = engines["urgent_first"]
    done = await engine.prefill("prefilled", [Message("user", PARTIAL)])
    assert done.evaluated_tokens > 0 and done.cached_tokens >= 100, done  # the user's line on the shared head
    again = await engine.prefill("prefilled", [Message("user", PARTIAL)])
    assert (again.cached_tokens, again.evaluated_tokens) == (done.prompt_tokens, 0), "nothing new: nothing evaluated"
    chunks = await _chunks(engine, "prefilled", WHOLE, score_turn_end=True)
    assert chunks[-1].cached_prompt_tokens >= done.prompt_tokens, (done, chunks[-1])
    # The same model on the same words, evaluated in other chunks: llama.cpp's sums differ in the last digits (the
    # score by < 0.01), and greedy decoding may then take the other of two close first tokens ("I can tell you..."
    # or "It will be sunny."), as it may between any two turns that hit the cache differently.
    plain = await _chunks(engine, "not-prefilled", WHOLE, score_turn_end=True)
    assert chunks[0].turn_end == pytest.approx(plain[0].turn_end, abs=0.02)
    assert _text(chunks).strip() and "\n" not in _text(chunks)
    # The prefill scored the turn end after its own words, as a reply to exactly those would; all cached, it did not.
    partial = await _chunks(engine, "partial-scored", PARTIAL + ".", score_turn_end=True)
    assert done.turn_end == pytest.approx(partial[0].turn_end, abs=0.02) and done.turn_end < 0.2, done
    assert again.turn_end is None


async def test_a_prefill_of_words_already_cached_keeps_what_follows_them(engines) -> None:
    engine = engines["urgent_first"]
    first = await _chunks(engine, "kept", WHOLE)
    done = await engine.prefill("kept", [Message("user", PARTIAL)])  # the start of what the cache holds
    assert done.evaluated_tokens == 0 and done.cached_tokens == done.prompt_tokens, done
    again = await _chunks(engine, "kept", WHOLE)
    assert again[-1].cached_prompt_tokens == first[-1].prompt_tokens - 1, "all but the token it samples from"


async def test_a_reply_that_comes_during_its_sessions_prefill_ends_it_and_keeps_what_it_evaluated(engines) -> None:
    engine = engines["urgent_first"]
    words = " ".join(["We walked along the river and talked about the old days"] * 6)  # several prefill steps
    prefill = asyncio.ensure_future(engine.prefill("raced", [Message("user", words)]))
    await asyncio.sleep(0.03)
    chunks = await _chunks(engine, "raced", words + " and then we went home.")
    done = await prefill
    assert done.evaluated_tokens < done.prompt_tokens - done.cached_tokens, "cut short by the reply"
    assert chunks[-1].cached_prompt_tokens >= done.cached_tokens + done.evaluated_tokens, "the same sequence"
    assert _text(chunks).strip()


async def test_a_prefill_runs_beside_another_sessions_reply_and_scores_its_words(engines) -> None:
    engine = engines["beside"]
    reply = asyncio.ensure_future(_chunks(engine, "serving", LONG, reply_prefix=LONG_START))
    await asyncio.sleep(0.05)
    await _admitted(engine)
    done = await engine.prefill("beside", [Message("user", PARTIAL)])
    assert not done.skipped and done.evaluated_tokens > 0 and done.turn_end is not None, done
    assert _text(await reply).strip()


async def test_a_prefill_is_skipped_at_once_while_no_sequence_is_free_or_its_session_is_served(engines) -> None:
    engine = engines["beside"]

    async def skipped_at_once(session: str) -> None:
        started = time.monotonic()
        done = await engine.prefill(session, [Message("user", PARTIAL)])
        assert done.skipped and done.evaluated_tokens == 0 and time.monotonic() - started < 0.05, session

    replies = [
        asyncio.ensure_future(_chunks(engine, f"full-{index}", LONG, reply_prefix=LONG_START))
        for index in range(MAX_BATCH - 1)
    ]
    await _admitted(engine)
    await skipped_at_once("full-0")  # a sequence is free, but this session's reply is under way
    replies.append(asyncio.ensure_future(_chunks(engine, "full-last", LONG, reply_prefix=LONG_START)))
    await asyncio.sleep(0.02)
    await skipped_at_once("no-room")
    await asyncio.gather(*replies)
    assert not (await engine.prefill("no-room", [Message("user", PARTIAL)])).skipped, "room again: it runs"


async def test_a_prefill_is_skipped_at_once_while_the_engine_serves_a_reply(engines) -> None:
    engine = engines["urgent_first"]
    reply = asyncio.ensure_future(_chunks(engine, "serving", LONG, reply_prefix=LONG_START))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    done = await engine.prefill("no-room", [Message("user", PARTIAL)])
    assert done.skipped and done.evaluated_tokens == 0 and time.monotonic() - started < 0.05
    await reply
    assert not (await engine.prefill("no-room", [Message("user", PARTIAL)])).skipped, "idle again: it runs"


async def test_a_reply_short_of_a_sequence_ends_another_sessions_prefill(engines) -> None:
    engine = engines["beside"]
    replies = [
        asyncio.ensure_future(_chunks(engine, f"busy-{index}", LONG, reply_prefix=LONG_START))
        for index in range(MAX_BATCH - 1)
    ]
    await _admitted(engine)
    words = " ".join(["We walked along the river and talked about the old days"] * 20)  # many prefill steps
    prefill = asyncio.ensure_future(engine.prefill("crowded-out", [Message("user", words)]))
    await _admitted(engine)
    chunks = await _chunks(engine, "latecomer", "What is the capital of France?")
    done = await prefill
    assert not done.skipped and done.evaluated_tokens < done.prompt_tokens - done.cached_tokens, done
    assert _text(chunks).strip()
    await asyncio.gather(*replies)


async def test_a_session_whose_sequence_was_taken_over_gets_its_copy_back(engines) -> None:
    engine = engines["urgent_first"]
    first = await _chunks(engine, "evicted", "What is the capital of France?")
    for index in range(MAX_BATCH):  # as many other sessions as there are sequences: the least recent goes
        await _chunks(engine, f"newcomer-{index}", f"Name a color, number {index}.")
    assert "evicted" in engine._saved
    dialogue = _follow_up(first)
    second = [c async for c in engine.generate(GenerationRequest("evicted", dialogue, max_tokens=16))]
    assert second[-1].cached_prompt_tokens > first[-1].prompt_tokens, (first[-1], second[-1])


async def test_a_new_session_starts_from_the_shared_head_of_the_prompt(engines) -> None:
    chunks = await _chunks(engines["urgent_first"], "fresh", "Tell me about cats.")
    assert chunks[-1].cached_prompt_tokens >= 100, "persona and examples come from the head sequence"


async def test_a_closed_reply_stops_within_a_step(engines) -> None:
    engine = engines["urgent_first"]
    request = GenerationRequest("cancel", [Message("user", LONG)], max_tokens=48, reply_prefix=LONG_START)
    stream = engine.generate(request)
    async for chunk in stream:
        if chunk.text:
            break
    await stream.aclose()
    await asyncio.sleep(0.05)
    steps = engine.steps
    await asyncio.sleep(0.3)
    assert engine.steps == steps, "nothing left to decode"
    assert not engine._active and not engine._waiting


async def test_the_turn_end_score_comes_before_the_reply(engines) -> None:
    finished = await _chunks(engines["urgent_first"], "score", "What is the capital of France?", score_turn_end=True)
    broken = await _chunks(engines["urgent_first"], "score-2", "I was wondering if the", score_turn_end=True)
    assert finished[0].turn_end is not None and broken[0].turn_end is not None
    assert not finished[0].text and _text(finished[1:]).strip()
    assert finished[0].turn_end > 0.5 > broken[0].turn_end, (finished[0].turn_end, broken[0].turn_end)


async def test_a_prompt_too_long_for_the_context_is_refused(engines) -> None:
    with pytest.raises(ValueError, match="tokens; at most"):
        await _chunks(engines["urgent_first"], "long", "word " * 3000)


@pytest.mark.parametrize("mode", ["urgent_first", "every_step"])
async def test_a_reply_far_ahead_of_its_listener_sits_out_a_new_turns_prompt(engines, mode: str) -> None:
    engine = engines[mode]
    request = GenerationRequest("ahead", [Message("user", LONG)], max_tokens=48, reply_prefix=LONG_START)
    said = ""
    stream = engine.generate(request)
    newcomer: asyncio.Future[list[GenerationChunk]] | None = None
    async for chunk in stream:
        said += chunk.text
        if newcomer is None and len(said) > 40:  # ~3 s of speech out within a fraction of one: far ahead
            sat_out = engine.sat_out
            newcomer = asyncio.ensure_future(_chunks(engine, "newcomer", "What is the capital of France?"))
    assert newcomer is not None
    assert _text(await newcomer).strip()
    if mode == "urgent_first":
        assert engine.sat_out > sat_out, "the long reply left the newcomer's prompt step to it"
    else:
        assert engine.sat_out == sat_out


async def test_a_saved_sequence_llama_cpp_will_not_take_back_fails_that_reply_alone(engines) -> None:
    engine = engines["every_step"]
    first = await _chunks(engine, "broken", "What is the capital of France?")
    for index in range(MAX_BATCH):
        await _chunks(engine, f"pusher-{index}", f"Name a fruit, number {index}.")
    saved = engine._saved["broken"]
    engine._saved["broken"] = SavedSequence(saved.tokens, saved.data[:64])  # cut short: llama.cpp refuses it
    dialogue = _follow_up(first)
    with pytest.raises(RuntimeError, match="did not take the saved sequence back"):
        [c async for c in engine.generate(GenerationRequest("broken", dialogue, max_tokens=16))]
    again = await _chunks(engine, "broken", "What is the capital of Italy?")
    assert _text(again).strip() and again[-1].finish_reason, "the engine, and the session, go on"


async def test_flow_control_keeps_a_reply_within_max_ahead_s_of_its_listener_and_it_says_the_same(engines) -> None:
    request = GenerationRequest("alphabet", [Message("user", LONG)], max_tokens=48, reply_prefix=LONG_START)
    alone = _text([chunk async for chunk in engines["every_step"].generate(request)])
    paced = engines["paced"]
    sat_out = paced.sat_out
    first_at = None
    said = ""
    async for chunk in paced.generate(request):
        if chunk.text:
            first_at = first_at or time.monotonic()
            said += chunk.text
            # Its listener started with the first words: what was streamed is at most max_ahead_s (and one token)
            # beyond what it has heard.
            assert speech_s(said) <= time.monotonic() - first_at + MIN_AHEAD_S + 0.5, said
    assert said == alone, "held back, it says exactly what it says unpaced"
    assert speech_s(said) > MIN_AHEAD_S + 1.0, "a reply long enough to be held back"
    assert paced.sat_out > sat_out


async def test_once_its_urgent_words_are_out_a_reply_steps_aside_for_the_tts_and_then_says_the_same(engines) -> None:
    request = GenerationRequest("dog", [Message("user", "Tell me about dogs.")], max_tokens=24, urgent_words=2)
    alone = _text([chunk async for chunk in engines["every_step"].generate(request)])
    said, arrivals = "", []
    async for chunk in engines["stepping_aside"].generate(request):
        if chunk.text:
            said += chunk.text
            arrivals.append((past_urgent(said, 2), time.monotonic()))
    assert said == alone, "the pause changes when, not what"
    out = next(index for index, (past, _) in enumerate(arrivals) if past)
    assert out + 1 < len(arrivals), "words came after the urgent ones"
    assert arrivals[out + 1][1] - arrivals[out][1] >= YIELD_S, "the next words waited out the TTS's first chunk"
    assert all(b[1] - a[1] < YIELD_S for a, b in zip(arrivals[out + 1 :], arrivals[out + 2 :], strict=False))


async def test_every_llama_cpp_computation_runs_on_the_engine_thread(monkeypatch) -> None:
    """llama.cpp's OpenMP keeps a team of threads per calling thread; with a second caller (the warm-up, once) a
    2-core process held more OpenMP threads than cores and every decode step ran 1.6 times slower
    (`python -m bench.llm_batch --calling-threads`). So the warm-up, the prompts and every step share one thread."""
    callers: set[int] = set()
    decode = llama_cpp.llama_decode

    def recorded(*args: object) -> int:
        callers.add(threading.get_ident())
        return decode(*args)

    monkeypatch.setattr(llama_cpp, "llama_decode", recorded)
    engine = LlamaBatchEngine(default_model_path(), max_batch=2)
    await engine.start()
    try:
        await asyncio.gather(_chunks(engine, "thread-a", "Hello there."), _chunks(engine, "thread-b", LONG))
    finally:
        await engine.close()
    assert len(callers) == 1 and threading.get_ident() not in callers, "one engine thread, not the event loop's"
