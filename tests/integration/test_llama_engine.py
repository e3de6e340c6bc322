"""The llama.cpp engine in process, on the real Gemma 3 270M: how it shares its slot between sessions."""

from __future__ import annotations

import asyncio
import threading
import time

import llama_cpp
import pytest
import pytest_asyncio

from services.llm.engine import GenerationRequest, Message
from services.llm.llama_common import MIN_AHEAD_S, default_model_path, past_urgent, speech_s
from services.llm.llama_cpp_engine import LlamaCppEngine

pytestmark = pytest.mark.integration

# A reply of ~45 tokens (the embedded model's persona keeps its own replies short): the alphabet, once begun.
LONG = "Say the alphabet."
LONG_START = "A, B, C, D, E,"
YIELD_S = 0.3  # far longer than a token, so the pause stands out


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines():
    engines = {
        "yielding": LlamaCppEngine(default_model_path()),
        "first_come": LlamaCppEngine(default_model_path(), yield_to_new_turns=False),
        "paced": LlamaCppEngine(default_model_path(), max_ahead_s=MIN_AHEAD_S),
        "stepping_aside": LlamaCppEngine(default_model_path(), first_chunk_yield_s=YIELD_S),
    }
    for engine in engines.values():
        await engine.start()
    yield engines
    for engine in engines.values():
        await engine.close()


async def _reply(
    engine: LlamaCppEngine, session: str, text: str, max_tokens: int = 48, start: str = ""
) -> tuple[str, float, float]:
    """(reply, when its first text came, when it ended), on the monotonic clock."""
    started = time.monotonic()
    first = None
    said = []
    request = GenerationRequest(session, [Message("user", text)], max_tokens=max_tokens, reply_prefix=start)
    async for chunk in engine.generate(request):
        if chunk.text:
            first = first or time.monotonic()
            said.append(chunk.text)
    return "".join(said), first or started, time.monotonic()


async def test_a_prefill_of_the_words_so_far_leaves_the_reply_only_the_rest_and_never_waits(engines) -> None:
    engine = engines["yielding"]
    partial, whole = "Can you tell me what the weather will", "Can you tell me what the weather will be like tomorrow?"
    done = await engine.prefill("prefilled", [Message("user", partial)])
    assert done.evaluated_tokens > 0 and done.cached_tokens + done.evaluated_tokens == done.prompt_tokens, done
    request = GenerationRequest("prefilled", [Message("user", whole)], max_tokens=8, score_turn_end=True)
    last = [chunk async for chunk in engine.generate(request)][-1]
    assert last.cached_prompt_tokens >= done.prompt_tokens, (done, last)
    again = await engine.prefill("prefilled", [Message("user", partial)])  # the start of what the slot holds
    assert again.evaluated_tokens == 0 and again.cached_tokens == again.prompt_tokens
    assert again.turn_end is None, "nothing evaluated: nothing scored"
    # It scores the turn end after its words, as a reply to exactly those words would (llama.cpp's sums differ in the
    # last digits between chunkings).
    ask = GenerationRequest("scored", [Message("user", partial + ".")], max_tokens=1, score_turn_end=True)
    scored = [chunk.turn_end async for chunk in engine.generate(ask) if chunk.turn_end is not None]
    assert done.turn_end == pytest.approx(scored[0], abs=0.02) and done.turn_end < 0.2, "'...the weather will'"
    last_again = [chunk async for chunk in engine.generate(request)][-1]
    assert last_again.cached_prompt_tokens >= last.prompt_tokens - 1, "what followed the words stayed cached"
    busy = asyncio.ensure_future(_reply(engine, "busy", LONG, start=LONG_START))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    skipped = await engine.prefill("waits-not", [Message("user", partial)])
    assert skipped.skipped and time.monotonic() - started < 0.05, "the slot serves a reply: skipped"
    await busy


@pytest.mark.parametrize("mode", ["yielding", "first_come"])
async def test_a_new_turns_first_words_do_not_wait_for_another_sessions_whole_reply(engines, mode: str) -> None:
    engine = engines[mode]
    started = time.monotonic()
    alone, _, alone_end = await _reply(engine, "alphabet-alone", LONG, start=LONG_START)
    assert len(alone.split()) >= 15, "a long reply, so there is something to wait for"
    long_call = asyncio.ensure_future(_reply(engine, "alphabet", LONG, start=LONG_START))
    await asyncio.sleep((alone_end - started) * 0.25)  # well into the long reply
    _, short_first_at, _ = await _reply(engine, "capital", "What is the capital of France?", max_tokens=8)
    long_text, _, long_end_at = await long_call
    if mode == "yielding":
        assert short_first_at < long_end_at - 0.2, "the new turn's first words came while the long reply went on"
        assert long_text == alone, "the reply that gave its slot up carried on exactly where it stopped"
    else:
        assert short_first_at >= long_end_at - 0.2, "first come, first served: the new turn waited (the control)"


async def test_a_saved_session_costs_megabytes_not_the_logits_of_every_token(engines) -> None:
    engine = engines["yielding"]
    for session in ("a", "b", "c"):
        await _reply(engine, f"saved-{session}", "My name is Ada and I live in a small house by the sea.", 8)
    saved = [engine._states[f"saved-{session}"] for session in ("a", "b", "c")]
    assert all(state.nbytes < 16 * 2**20 for state in saved), [state.nbytes for state in saved]
    # Session a's state, put back after b and c used the slot, still serves its next turn from the cache.
    request = GenerationRequest(
        "saved-a",
        [
            Message("user", "My name is Ada and I live in a small house by the sea."),
            Message("assistant", "Nice to meet you."),
            Message("user", "What is my name?"),
        ],
        max_tokens=4,
    )
    last = [chunk async for chunk in engine.generate(request)][-1]
    assert last.prompt_tokens - last.cached_prompt_tokens < 25, (last.prompt_tokens, last.cached_prompt_tokens)


async def test_a_reply_decodes_no_further_ahead_of_its_playout_than_max_ahead_s_and_says_the_same(engines) -> None:
    alone, _, _ = await _reply(engines["yielding"], "alphabet-free", LONG, start=LONG_START)
    paced = engines["paced"]
    text, first_at, end_at = await _reply(paced, "alphabet-paced", LONG, start=LONG_START)
    assert text == alone, "held back and resumed from its saved state, it says exactly what it would have"
    assert speech_s(text) > MIN_AHEAD_S + 1.0, "a reply long enough to be held back"
    assert paced.held_back >= 1
    # It streamed at most max_ahead_s (and one token) ahead of a listener who started once its urgent words were out.
    assert end_at - first_at >= speech_s(text) - MIN_AHEAD_S - 0.5


async def test_once_its_urgent_words_are_out_a_reply_steps_aside_for_the_tts_and_then_says_the_same(engines) -> None:
    request = GenerationRequest("dog", [Message("user", "Tell me about dogs.")], max_tokens=24, urgent_words=2)
    alone = "".join([chunk.text async for chunk in engines["first_come"].generate(request)])
    engine = engines["stepping_aside"]
    stepped_aside = engine.stepped_aside
    said, arrivals = "", []
    async for chunk in engine.generate(request):
        if chunk.text:
            said += chunk.text
            arrivals.append((past_urgent(said, 2), time.monotonic()))
    assert said == alone, "the pause changes when, not what"
    assert engine.stepped_aside == stepped_aside + 1, "once per reply"
    out = next(index for index, (past, _) in enumerate(arrivals) if past)
    assert out + 1 < len(arrivals), "words came after the urgent ones"
    assert arrivals[out + 1][1] - arrivals[out][1] >= YIELD_S, "the next words waited out the TTS's first chunk"


async def test_a_call_that_comes_while_a_reply_steps_aside_does_not_wait_out_the_pause(engines) -> None:
    engine = engines["stepping_aside"]
    request = GenerationRequest("aside", [Message("user", "Tell me about dogs.")], max_tokens=24, urgent_words=2)
    said = ""
    newcomer: asyncio.Future[tuple[str, float, float]] | None = None
    async for chunk in engine.generate(request):
        said += chunk.text
        if newcomer is None and past_urgent(said, 2):  # the reply pauses now, for YIELD_S
            asked = time.monotonic()
            newcomer = asyncio.ensure_future(_reply(engine, "newcomer", "Say hello.", max_tokens=4))
    assert newcomer is not None
    _, first, _ = await newcomer
    # Waiting out the pause, they came 0.47 s after it asked; without, 0.17 s (a token, a swap, its prefill).
    assert first - asked < YIELD_S, f"its first words came {first - asked:.3f} s after it asked"


async def test_each_slot_computes_on_one_thread_of_its_own(monkeypatch) -> None:
    """As the batched engine: a second thread calling llama.cpp leaves a second OpenMP team, which on 2 cores made
    every decode step 1.6 times slower. Replies of different sessions, one after another, share the slot's thread."""
    callers: set[int] = set()
    decode = llama_cpp.llama_cpp.llama_decode  # what llama-cpp-python's Llama calls

    def recorded(*args: object) -> int:
        callers.add(threading.get_ident())
        return decode(*args)

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_decode", recorded)
    engine = LlamaCppEngine(default_model_path())
    await engine.start()
    try:
        for index in range(3):
            # Other work of the process on the default executor's threads (gRPC's, the event loop's helpers).
            busy = [asyncio.get_running_loop().run_in_executor(None, time.sleep, 0.3) for _ in range(index + 1)]
            await _reply(engine, f"slot-thread-{index}", "Hello there.", max_tokens=4)
            await asyncio.gather(*busy)
    finally:
        await engine.close()
    assert len(callers) == 1 and threading.get_ident() not in callers
