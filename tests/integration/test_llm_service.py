"""The LLM service on the real Gemma 3 270M GGUF through llama.cpp, over real gRPC."""

from __future__ import annotations

import asyncio
import itertools
import re

import grpc
import pytest

from services.llm import server as llm_server
from tests.integration.helpers import expect_error
from voicemesh import clients
from voicemesh.endpointing import TurnEndCalibration
from voicemesh.v1 import llm_pb2, llm_pb2_grpc

pytestmark = pytest.mark.integration
USER = llm_pb2.ROLE_USER
ASSISTANT = llm_pb2.ROLE_ASSISTANT


async def test_streams_a_short_reply_with_timings_and_usage(services: dict[str, str]) -> None:
    responses = [r async for r in clients.generate(services["llm"], [(USER, "What is the capital of France?")])]
    deltas = [r.text_delta for r in responses if r.text_delta]
    assert len(deltas) >= 2, "the reply arrives as several deltas, not one block"
    text = "".join(deltas)
    assert "Paris" in text and "\n" not in text
    first, last = responses[0], responses[-1]
    assert first.ttft_ms > 0 and first.replica and first.model.startswith("gemma")
    assert last.finish_reason in (llm_pb2.FINISH_REASON_STOP, llm_pb2.FINISH_REASON_LENGTH)
    assert last.usage.prompt_tokens > 20 and 0 < last.usage.completion_tokens <= 48


async def test_follow_up_turn_reuses_the_session_prefix(services: dict[str, str]) -> None:
    history = [(USER, "My name is Ada. Please remember it.")]
    first = [r async for r in clients.generate(services["llm"], history, session_id="prefix-test")]
    reply = "".join(r.text_delta for r in first)
    history += [(llm_pb2.ROLE_ASSISTANT, reply or "Okay."), (USER, "What is my name?")]
    second = [r async for r in clients.generate(services["llm"], history, session_id="prefix-test")]
    usage = second[-1].usage
    # Everything before the new user line was already in the KV cache.
    assert usage.cached_prompt_tokens >= first[-1].usage.prompt_tokens - 2
    assert usage.prompt_tokens - usage.cached_prompt_tokens < 20


async def test_cancel_frees_the_slot_at_once(services: dict[str, str]) -> None:
    long_request = llm_pb2.GenerateRequest(
        session_id="long",
        messages=[llm_pb2.ChatMessage(role=USER, content="Count from one to five hundred, separated by commas.")],
        max_tokens=500,
        stop=["\n\n"],
    )
    async with grpc.aio.insecure_channel(services["llm"]) as channel:
        stub = llm_pb2_grpc.GeneratorStub(channel)
        call = stub.Generate(long_request)
        async for response in call:
            if response.text_delta:
                break  # first token arrived: the slot is busy generating up to 500 tokens (~15 s here)
        call.cancel()
        follow = [r async for r in clients.generate(services["llm"], [(USER, "Say hello.")])]
    # With one slot, the next request would otherwise wait for the whole 500-token generation.
    assert follow[0].queue_ms < 2000, f"waited {follow[0].queue_ms:.0f} ms for the slot after a cancel"


def _request(**fields: object) -> llm_pb2.GenerateRequest:
    base: dict[str, object] = {"session_id": "bad", "messages": [llm_pb2.ChatMessage(role=USER, content="Hi")]}
    base.update(fields)
    return llm_pb2.GenerateRequest(**base)


@pytest.mark.parametrize(
    ("request_", "code", "words"),
    [
        (_request(max_tokens=100000), grpc.StatusCode.OUT_OF_RANGE, ("max_tokens=100000", "1-512")),
        (_request(messages=[]), grpc.StatusCode.INVALID_ARGUMENT, ("messages is empty",)),
        (_request(session_id=""), grpc.StatusCode.INVALID_ARGUMENT, ("session_id",)),
        (
            _request(messages=[llm_pb2.ChatMessage(role=USER, content="  ")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            ("messages[0].content is empty",),
        ),
        (
            _request(messages=[llm_pb2.ChatMessage(content="Hi")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            ("messages[0].role",),
        ),
        (
            _request(messages=[llm_pb2.ChatMessage(role=llm_pb2.ROLE_ASSISTANT, content="Hi")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            ("last message", "ROLE_USER"),
        ),
        (
            _request(messages=[llm_pb2.ChatMessage(role=USER, content="Hi", interrupted=True)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            ("messages[0].interrupted", "ROLE_USER", "only a ROLE_ASSISTANT reply"),
        ),
        (_request(temperature=5), grpc.StatusCode.OUT_OF_RANGE, ("temperature=5",)),
        (
            _request(messages=[llm_pb2.ChatMessage(role=USER, content="word " * 4000)]),
            grpc.StatusCode.OUT_OF_RANGE,
            ("characters",),
        ),
    ],
)
async def test_bad_input_gets_a_clear_status(services: dict[str, str], request_, code, words) -> None:
    async with grpc.aio.insecure_channel(services["llm"]) as channel:
        await expect_error(llm_pb2_grpc.GeneratorStub(channel).Generate(request_), code, *words)


async def test_a_prefill_of_the_words_so_far_leaves_the_reply_only_the_rest(services: dict[str, str]) -> None:
    partial = [llm_pb2.ChatMessage(role=USER, content="Can you tell me what the weather will")]
    async with grpc.aio.insecure_channel(services["llm"]) as channel:
        stub = llm_pb2_grpc.GeneratorStub(channel)
        done = await stub.Prefill(llm_pb2.PrefillRequest(session_id="prefill-test", messages=partial))
        assert done.evaluated_tokens > 0 and done.replica and not done.unsupported, done
        assert done.HasField("turn_end") and 0 <= done.turn_end.probability < 0.2, "'...the weather will': not done"
        again = await stub.Prefill(llm_pb2.PrefillRequest(session_id="prefill-test", messages=partial))
        assert again.evaluated_tokens == 0 and again.cached_prompt_tokens == done.prompt_tokens
        assert not again.HasField("turn_end"), "nothing evaluated: nothing scored"
    whole = [(USER, "Can you tell me what the weather will be like tomorrow?")]
    last = [r async for r in clients.generate(services["llm"], whole, session_id="prefill-test")][-1]
    assert last.usage.cached_prompt_tokens >= done.prompt_tokens


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (llm_pb2.PrefillRequest(session_id="bad"), ("messages is empty",)),
        (llm_pb2.PrefillRequest(messages=[llm_pb2.ChatMessage(role=USER, content="Hi")]), ("session_id",)),
        (
            llm_pb2.PrefillRequest(session_id="bad", messages=[llm_pb2.ChatMessage(role=ASSISTANT, content="Hi")]),
            ("last message", "ROLE_USER"),
        ),
    ],
)
async def test_a_bad_prefill_gets_a_clear_status(services: dict[str, str], request_, words) -> None:
    async with grpc.aio.insecure_channel(services["llm"]) as channel:
        stub = llm_pb2_grpc.GeneratorStub(channel)
        await expect_error(stub.Prefill(request_), grpc.StatusCode.INVALID_ARGUMENT, *words)


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


async def test_an_interrupted_reply_is_not_imitated_in_later_turns(services: dict[str, str]) -> None:
    """Barge-in leaves only the heard words of a reply in the history. Rendered as an Assistant line, this dialogue
    made every later reply "That is"; marked `interrupted`, the fragment stays context and is not repeated."""
    session = "barge-in-fragment"
    history = [llm_pb2.ChatMessage(role=USER, content="Do you know what I did today?")]
    usage: list[llm_pb2.Usage] = []
    replies: list[str] = []

    async def reply(stub: llm_pb2_grpc.GeneratorStub) -> str:
        request = llm_pb2.GenerateRequest(session_id=session, messages=history, temperature=0)
        responses = [r async for r in stub.Generate(request)]
        usage.append(responses[-1].usage)
        return "".join(r.text_delta for r in responses).strip()

    async with grpc.aio.insecure_channel(services["llm"]) as channel:
        stub = llm_pb2_grpc.GeneratorStub(channel)
        await reply(stub)  # the reply the user spoke over: only "That is" of it was heard
        history.append(llm_pb2.ChatMessage(role=ASSISTANT, content="That is", interrupted=True))
        for said in ("I went for a swim in the lake.", "The water was very cold.", "Tomorrow I will go running."):
            history.append(llm_pb2.ChatMessage(role=USER, content=said))
            text = await reply(stub)
            replies.append(text)
            history.append(llm_pb2.ChatMessage(role=ASSISTANT, content=text or "Okay."))
    for text in replies:
        assert _words(text) not in ("", "that is"), f"a later reply repeats the heard fragment: {replies}"
        assert "interrupt" not in text.lower(), f"a later reply copies the interruption note: {replies}"
    # The session's prompt still grows by appending: the turn after the interruption reuses everything up to the
    # interrupted turn's `Assistant:` cue (which the note replaces), each later turn all of the turn before it.
    assert usage[1].cached_prompt_tokens >= usage[0].prompt_tokens - 4, usage[:2]
    for before, after in itertools.pairwise(usage[1:]):
        assert after.cached_prompt_tokens >= before.prompt_tokens - 2, (before, after)


async def test_concurrent_requests_queue_and_all_complete(services: dict[str, str]) -> None:
    async def ask(index: int) -> list[llm_pb2.GenerateResponse]:
        return [r async for r in clients.generate(services["llm"], [(USER, f"Name a color, number {index}.")])]

    results = await asyncio.gather(*(ask(i) for i in range(3)))
    assert all(r[-1].finish_reason for r in results)
    assert all(r[0].replica and r[0].ttft_ms > 0 for r in results), "each says where and how fast it was served"


async def test_a_reply_prefix_is_continued_not_repeated(services: dict[str, str]) -> None:
    """What a replica that died mid-reply had streamed goes back as `reply_prefix`; the next one carries on."""
    messages = [llm_pb2.ChatMessage(role=USER, content="What is the capital of France?")]
    whole = [r async for r in clients.generate(services["llm"], [(USER, "What is the capital of France?")])]
    text = "".join(r.text_delta for r in whole)
    prefix = text[: len(text) // 2].rstrip()
    request = llm_pb2.GenerateRequest(session_id="continued", messages=messages, reply_prefix=prefix)
    async with grpc.aio.insecure_channel(services["llm"]) as channel:
        rest = "".join([r.text_delta async for r in llm_pb2_grpc.GeneratorStub(channel).Generate(request)])
    assert rest and not rest.strip().startswith(prefix.split()[0]), (prefix, rest)
    assert prefix + rest == text, "greedy decoding: the continuation is the rest of the same reply"


async def _scored(target: str, text: str) -> list[llm_pb2.GenerateResponse]:
    request = llm_pb2.GenerateRequest(
        session_id="turn-end", messages=[llm_pb2.ChatMessage(role=USER, content=text)], score_turn_end=True
    )
    async with grpc.aio.insecure_channel(target) as channel:
        return [r async for r in llm_pb2_grpc.GeneratorStub(channel).Generate(request) if r.ByteSize()]  # no keepalive


async def test_the_turn_end_score_comes_first_and_tells_a_finished_sentence_from_a_broken_off_one(
    services: dict[str, str],
) -> None:
    """Whisper ends both with a full stop; the model's P(end) after the last word tells them apart."""
    finished = await _scored(services["llm"], "The child almost hurt the small dog.")
    broken_off = await _scored(services["llm"], "The child almost hurt.")
    for responses in (finished, broken_off):
        assert responses[0].HasField("turn_end") and not responses[0].text_delta
        assert not any(r.HasField("turn_end") for r in responses[1:])
        assert responses[1].ttft_ms > 0 and "".join(r.text_delta for r in responses).strip(), "the reply follows"
    p_finished, p_broken = finished[0].turn_end.probability, broken_off[0].turn_end.probability
    assert p_finished > 0.2 > 0.02 > p_broken, (p_finished, p_broken)
    # The default scorer's scores are the common scale: the replica sends them as the model gave them.
    assert finished[0].turn_end.model_probability == pytest.approx(p_finished, abs=1e-6)


async def test_a_replica_puts_its_models_turn_end_scores_on_the_common_scale() -> None:
    """A replica told where its model's scores sit (as for a model that scores every line higher: finished from 0.9,
    unfinished up to 0.5) sends each score mapped onto the scale the gateway and the ASR read, from replies and
    prefills alike, with the model's own probability beside it."""
    calibration = TurnEndCalibration(complete_at=0.9, incomplete_at=0.5)
    server = llm_server.build_server(
        llm_server.LlmSettings(port=0, turn_end_complete_at=0.9, turn_end_incomplete_at=0.5)
    )
    await server.start()
    target = f"127.0.0.1:{server.port}"
    try:
        replied = await _scored(target, "The child almost hurt the small dog.")
        async with grpc.aio.insecure_channel(target) as channel:
            prefilled = await llm_pb2_grpc.GeneratorStub(channel).Prefill(
                llm_pb2.PrefillRequest(
                    session_id="calibrated", messages=[llm_pb2.ChatMessage(role=USER, content="The horizon seems")]
                )
            )
    finally:
        await server.stop()
    for turn_end in (replied[0].turn_end, prefilled.turn_end):
        model = turn_end.model_probability
        assert 0 < model < 1
        assert turn_end.probability == pytest.approx(calibration.standard(model), abs=1e-6)
    # Gemma's ~0.45 for the finished sentence is, for a model that scores everything higher, a doubtful score.
    assert replied[0].turn_end.probability < 0.9 * replied[0].turn_end.model_probability


async def test_no_turn_end_score_without_the_flag_or_when_continuing_a_reply(services: dict[str, str]) -> None:
    plain = [r async for r in clients.generate(services["llm"], [(USER, "What is the capital of France?")])]
    request = llm_pb2.GenerateRequest(
        session_id="continued-scored",
        messages=[llm_pb2.ChatMessage(role=USER, content="What is the capital of France?")],
        reply_prefix="The capital",
        score_turn_end=True,
    )
    async with grpc.aio.insecure_channel(services["llm"]) as channel:
        continued = [r async for r in llm_pb2_grpc.GeneratorStub(channel).Generate(request)]
    assert not any(r.HasField("turn_end") for r in plain + continued)
