"""The pieces of failover, without services: what a replacement stream is given, how a hung call is noticed, how a
reply is continued, and the bound on events a client does not read."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc
import pytest

from gateway import turn
from gateway.links import RETAIN_PREROLL_MS, unsynthesized
from gateway.outbox import MAX_PENDING_EVENTS
from gateway.session import Session
from gateway.streams import Silence, watched
from services.llm.engine import Message
from services.llm.prompt import CompletionPrompt
from services.llm.server import to_request, with_keepalives
from tests.unit.fake_backends import FakeBackends, until
from tests.unit.test_session import new_session
from voicemesh.errors import RequestError
from voicemesh.v1 import asr_pb2, audio_pb2, conversation_pb2, llm_pb2


@pytest.mark.parametrize(
    ("chunks", "rest"),
    [
        ([], "Hello there,  my friend. How are you?"),
        (["Hello there,"], "  my friend. How are you?"),
        (["Hello there,", "my friend."], " How are you?"),
        (["Hello there,", "my friend.", "How are you?"], ""),
    ],
)
def test_the_unsynthesized_rest_starts_after_the_chunks_heard_whole(chunks: list[str], rest: str) -> None:
    assert unsynthesized("Hello there,  my friend. How are you?", chunks) == rest


def test_a_replaced_asr_stream_drops_the_speculative_reply_it_started() -> None:
    controller = turn.TurnController()
    controller.on_speech_started(0)
    (start,) = controller.on_candidate(100, "what time is it")
    assert isinstance(start, turn.StartReply)
    assert controller.on_asr_restarted() == [turn.CancelReply(start.reply_id)]
    assert controller.on_asr_restarted() == []


def test_a_continued_reply_is_rendered_after_its_start() -> None:
    prompt = CompletionPrompt()
    messages = [Message("user", "Tell me about the sea.")]
    assert prompt.render(messages).endswith("User: Tell me about the sea.\nAssistant:")
    continued = prompt.render(messages, "The sea is wide and ")
    assert continued.endswith("User: Tell me about the sea.\nAssistant: The sea is wide and")
    assert continued.startswith(prompt.render(messages)), "the prompt only grows: the prefix cache still hits"


@pytest.mark.parametrize("prefix", ["a" * 4001, "two\nlines"])
def test_a_reply_prefix_that_is_not_one_line_of_a_reply_is_refused(prefix: str) -> None:
    request = llm_pb2.GenerateRequest(
        session_id="s", messages=[llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content="hi")], reply_prefix=prefix
    )
    with pytest.raises(RequestError) as refused:
        to_request(request)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "reply_prefix" in refused.value.message


class Hanging:
    """A call that sends `sent` and then nothing, ever (a SIGSTOPped replica)."""

    def __init__(self, *sent: str) -> None:
        self.sent = list(sent)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._run()

    async def _run(self) -> AsyncIterator[str]:
        for message in self.sent:
            yield message
        await asyncio.Event().wait()


async def test_a_call_that_goes_quiet_past_its_limit_is_given_up() -> None:
    silence = Silence("LLM", first_s=10.0, quiet_s=0.05)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as stalled:
        async for message in watched(Hanging("first", "second"), silence.problem, every_s=0.01):
            silence.heard()
            received.append(message)
    assert received == ["first", "second"]
    assert stalled.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "LLM replica sent nothing" in (stalled.value.details() or "")


async def test_a_call_that_sends_nothing_at_all_is_hung_long_before_the_first_token_limit() -> None:
    """A live replica sends keepalives while it waits; one SIGSTOPped before it answered sends nothing."""
    silence = Silence("LLM", first_s=10.0, quiet_s=0.05)
    with pytest.raises(grpc.aio.AioRpcError) as stalled:
        async with asyncio.timeout(1.0):
            async for _ in watched(Hanging(), silence.problem, every_s=0.01):
                pass
    assert "LLM replica sent nothing" in (stalled.value.details() or "")


async def test_keepalives_keep_a_call_alive_but_not_past_the_first_token_limit() -> None:
    async def keepalives() -> AsyncIterator[llm_pb2.GenerateResponse]:
        while True:
            await asyncio.sleep(0.01)
            yield llm_pb2.GenerateResponse()

    silence = Silence("LLM", first_s=0.2, quiet_s=0.05)
    received = 0
    with pytest.raises(grpc.aio.AioRpcError) as slow:
        async for message in watched(keepalives(), silence.problem, every_s=0.01):
            silence.heard(content=bool(message.text_delta or message.finish_reason))
            received += 1
    assert received > 5, "alive: the 50 ms quiet limit never struck"
    assert "LLM replica sent no content in 0.2 s" in (slow.value.details() or "")


async def test_the_llm_service_sends_keepalives_while_its_engine_is_quiet() -> None:
    async def engine() -> AsyncIterator[str]:
        await asyncio.sleep(0.2)  # waiting for a slot, prefilling
        yield "Hello"
        await asyncio.sleep(0.2)  # sitting out for a new turn's first words
        yield " there"

    received = [item async for item in with_keepalives(engine(), every_s=0.05)]
    assert [item for item in received if item] == ["Hello", " there"], "the engine's items, in order, each once"
    hello = received.index("Hello")
    assert hello >= 1 and received[0] is None, "keepalives before the first token"
    assert None in received[hello:], "and while it sits out"


async def test_closing_the_keepalive_stream_cancels_the_engines_pending_step() -> None:
    cleaned = asyncio.Event()

    async def engine() -> AsyncIterator[str]:
        try:
            await asyncio.Event().wait()
            yield "never"
        finally:
            cleaned.set()  # the engine's cleanup: its slot is freed

    stream = with_keepalives(engine(), every_s=0.01)
    assert await anext(stream) is None
    await stream.aclose()
    assert cleaned.is_set()


async def test_a_quiet_call_is_left_alone_while_nothing_is_wrong() -> None:
    async def three() -> AsyncIterator[int]:
        for index in range(3):
            await asyncio.sleep(0.03)
            yield index

    assert [m async for m in watched(three(), lambda: None, every_s=0.01)] == [0, 1, 2]


def frame(index: int) -> audio_pb2.AudioFrame:
    return audio_pb2.AudioFrame(data=b"\x00\x00" * 320, seq=index)


async def test_the_audio_kept_for_a_replay_is_the_turn_in_progress_or_the_last_second() -> None:
    backends = FakeBackends()
    session = new_session(backends)
    await until(lambda: session.asr.queue is not None)
    for index in range(200):  # 4 s between turns; the ASR acknowledges it all
        session.push_frame(frame(index))
    backends.say(progress=asr_pb2.Progress(), audio_received_ms=4000, frames_received=200)
    await until(lambda: session.asr.acked == 200)
    assert len(session.asr.retained) == 50, "between turns: the last second"
    backends.say(speech_started=asr_pb2.SpeechStarted(), speech_start_ms=3900, audio_received_ms=4000)
    for index in range(200, 600):  # an 8 s utterance: all of it is kept, and its pre-roll
        session.push_frame(frame(index))
    backends.say(progress=asr_pb2.Progress(), audio_received_ms=12000, frames_received=600)
    await until(lambda: session.asr.acked == 600)
    assert len(session.asr.retained) == (12000 - 3900 + RETAIN_PREROLL_MS) // 20
    backends.say(final=asr_pb2.Final(text="done"), speech_end_ms=11900, audio_received_ms=12000)
    session.push_frame(frame(600))
    await until(lambda: len(session.asr.retained) == 4)  # from 50 ms after the speech end: 11960-12020
    await session.close()


async def test_an_asr_stream_that_stops_acknowledging_is_noticed() -> None:
    backends = FakeBackends()
    session = new_session(backends)
    await until(lambda: session.asr.queue is not None)
    session.push_frame(frame(0))
    backends.say(progress=asr_pb2.Progress(), frames_received=1)
    await until(lambda: session.asr.acks)
    assert session.asr._stalled() is None
    session.push_frame(frame(1))
    assert session.asr.waiting_since is not None
    session.asr.waiting_since -= 2000  # two seconds later, still no acknowledgement
    assert "acknowledged no audio" in (session.asr._stalled() or "")
    await session.close()


async def test_a_client_that_reads_no_events_ends_its_session_not_the_gateways_memory() -> None:
    session = new_session(FakeBackends())
    for index in range(MAX_PENDING_EVENTS + 10):
        session.deliver(conversation_pb2.ConverseEvent(turn_index=index))
    assert session.events.qsize() == 1
    refusal = session.events.get_nowait()
    assert isinstance(refusal, RequestError) and refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "read none" in refusal.message
    session.deliver(conversation_pb2.ConverseEvent())
    assert session.events.empty(), "nothing more is queued for it"
    await session.close()


class FakeCountingBackends(FakeBackends):
    """The LLM reports its usage as a real one does: 50 tokens of prompt per message, 10 of reply."""

    async def generate(
        self, request: llm_pb2.GenerateRequest, metadata: object = None
    ) -> AsyncIterator[llm_pb2.GenerateResponse]:
        yield llm_pb2.GenerateResponse(text_delta="Fine.")
        usage = llm_pb2.Usage(prompt_tokens=50 * len(request.messages), completion_tokens=10)
        yield llm_pb2.GenerateResponse(finish_reason=llm_pb2.FINISH_REASON_STOP, usage=usage)


async def test_the_history_is_trimmed_to_a_token_budget_by_the_llms_own_count() -> None:
    backends = FakeCountingBackends()
    options = new_session(backends).options
    session = Session(options, backends, [], history_max_tokens=400)  # type: ignore[arg-type]  # a fake's streams
    await until(lambda: backends.tts_connected and session.asr.queue is not None)
    lengths = []
    for turn_index in range(12):
        backends.say(speech_started=asr_pb2.SpeechStarted())
        backends.say(final=asr_pb2.Final(text=f"question number {turn_index}"))
        await until(lambda: session.playout.queued > 0)
        while session.playout.take() is not None or session.playout.queued:
            await asyncio.sleep(0.005)
        await until(lambda: session._current is None)
        lengths.append(len(session.history))
    # Each turn's prompt is 100 tokens longer (two more messages); once prompt and reply pass 400, the oldest half
    # of the history goes. Unbounded, it would hold 24 entries.
    assert max(lengths) <= 8, lengths
    assert any(later < earlier for earlier, later in itertools.pairwise(lengths)), lengths
    assert session.history[0].role == "user" and session.history[-1].text == "Fine."
    await session.close()
