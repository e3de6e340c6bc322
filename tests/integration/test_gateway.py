"""The conversation pipeline end to end: real ASR, LLM and TTS processes, the gateway on loopback."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import pytest_asyncio

from gateway.server import GatewaySettings, build_server
from harness.clips import spoken
from tests.conftest import free_port, load_clip
from tests.integration.helpers import expect_error, requests, start_gateway, start_offline_gateway
from voicemesh import clients
from voicemesh.audio import Clip, float_to_pcm16, pcm16_to_float
from voicemesh.clients import pcm_frame
from voicemesh.conversation import (
    AfterFirstAudio,
    ConversationClient,
    Interrupted,
    ReplyAudio,
    ReplyDone,
    ReplyText,
    SessionError,
    TurnMetrics,
    UserTranscript,
    talk,
)
from voicemesh.mesh import Mesh
from voicemesh.v1 import asr_pb2, conversation_pb2, conversation_pb2_grpc

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def gateway(services: dict[str, str]):
    server = await start_gateway(services["asr"], services["llm"], services["tts"])
    yield server
    await server.stop()


def target(server) -> str:
    return f"127.0.0.1:{server.port}"


def join(*parts: Clip | float) -> Clip:
    """Clips and seconds of silence, one after another, at 16 kHz."""
    pieces = [np.zeros(int(p * 16000), np.float32) if isinstance(p, float) else p.to_rate(16000).samples for p in parts]
    return Clip(np.concatenate(pieces), 16000)


async def transcribe(services: dict[str, str], pcm: bytes) -> str:
    audio = Clip(pcm16_to_float(pcm), 16000)
    events = [e async for _, e in clients.recognize(services["asr"], audio, realtime=False)]
    return " ".join(e.final.text for e in events if e.WhichOneof("event") == "final")


async def test_a_spoken_question_gets_a_spoken_reply_with_a_complete_turn_metric(services, gateway) -> None:
    turns, audio, events = await talk(target(gateway), load_clip("spk1_snt1"), trailing_silence_s=2.0)
    assert len(turns) == 1
    turn = turns[0]
    assert "child" in turn.user_text.lower()
    assert turn.reply_text and turn.v2v_ms is not None and turn.v2v_ms > 0
    assert len(audio) > 16000  # more than half a second of reply
    heard = await transcribe(services, audio)
    assert heard.strip(), "the reply audio, transcribed by the ASR service, says something"
    metrics = turn.metrics.server
    assert metrics.v2v_ms > 0 and metrics.endpoint_ms > 0 and metrics.upload_ms >= 0
    assert metrics.asr_compute_ms > 0 and metrics.llm_first_token_ms > 0 and metrics.tts_first_audio_ms > 0
    assert metrics.first_audio_sent_us > metrics.speech_end_capture_us > 0
    assert metrics.llm_replica and metrics.completion_tokens > 0 and metrics.reply_audio_ms > 0
    # The LLM scored the finished sentence, and that score set the pause's hangover.
    assert 0 < metrics.turn_end_probability <= 1 and 0 <= metrics.completeness <= 1
    assert 32 <= metrics.hangover_ms <= 1200
    assert 0 < metrics.turn_score_ms <= metrics.endpoint_ms, "the score reached the gateway before the commit"
    assert turn.metrics.first_audio_received_us >= metrics.first_audio_sent_us, "the downlink was measured"
    assert turn.metrics.downlink_ms < 1000
    # The stages that run one after another fit inside the gateway's V2V, unless they ran before the speech ended.
    if metrics.started_on_partial:
        assert metrics.speculative_used
    else:
        assert metrics.llm_first_token_ms + metrics.tts_first_audio_ms < metrics.v2v_ms
    assert not any(isinstance(e, SessionError) for e in events)


async def test_two_turns_share_history_and_the_prefix_cache(gateway) -> None:
    clip = join(load_clip("spk2_snt1"), 5.0, load_clip("horizon"))
    turns, _, events = await talk(target(gateway), clip, trailing_silence_s=3.0)
    assert len(turns) == 2, [t.user_text for t in turns]
    first, second = (t.metrics.server for t in turns)
    # The second prompt contains the first exchange, and more of it than the shared persona came from the cache.
    assert second.prompt_tokens > first.prompt_tokens
    assert second.cached_prompt_tokens > first.cached_prompt_tokens
    session_id = next(e.session_id for e in events if type(e).__name__ == "Started")
    history = gateway.servicer.history(session_id)
    assert [entry.role for entry in history] == ["user", "assistant", "user", "assistant"]


async def test_barge_in_stops_the_reply_and_keeps_only_spoken_text(services, gateway) -> None:
    """The user talks over a long reply (wizard.wav, 0.5 s after the reply's first audio reached the client).

    One take, with fixed inputs: the question is Piper's noiseless reading (`harness.clips.spoken`: the same samples
    in every run), checked once to be heard as asked, and wizard.wav is a recording. The interruption is mixed into
    the frames not yet sent at a fixed offset from the reply's first audio (`AfterFirstAudio`), not at a time guessed
    from the start, so it lands on the reply however late the reply starts. A failure here is the pipeline's."""
    # A question answered at length: spk1_snt1's one-line answer could end before the barge-in is heard (it did
    # once in a full suite: no Interrupted at all).
    config = conversation_pb2.SessionConfig(
        system_prompt="A talkative assistant who always answers with three long sentences.",
        options=conversation_pb2.PipelineOptions(max_tokens=120),
    )
    question = await speech_of(services, QUESTION, QUESTION_WORDS)
    # `talk` mixes the interruption into the frames not sent yet, the stream lengthened to hold it and 5 s of silence
    # after it (for its own turn) however late the reply starts; the silence after the question only has to outlast
    # the reply's start. (With 5 s and no more, a reply that started late found the stream over, and the test said
    # only that nothing was interrupted.)
    trailing_s = 15.0
    wizard = load_clip("wizard")
    then_quiet = Clip(np.zeros(int((wizard.duration_s + 5.0) * 16000), np.float32), 16000)
    turns, _, events = await talk(
        target(gateway),
        question,
        config,
        trailing_silence_s=trailing_s,
        # the user talks over the reply, 0.5 s into it, then is quiet
        inject=[(AfterFirstAudio(0.5), wizard), (AfterFirstAudio(0.5), then_quiet)],
    )
    # The premise: the question was heard as asked. A mishearing ("Can you? Tell me along.") gets a four-word answer
    # that is over before the user speaks, and the barge-in below would not be tested.
    heard_question = [t.user_text for t in turns]
    assert any(word in text.lower() for text in heard_question for word in QUESTION_WORDS), (
        f"the question was misheard: {heard_question}"
    )
    # ... and the reply started while the stream was still being sent, so the interruption went out with it.
    started_s = (turns[0].first_audio_received_us - turns[0].speech_end_sent_us) / 1e6
    assert started_s < trailing_s - 1.0, f"the reply began {started_s:.1f} s after the question, past the stream"
    interrupted = [i for i, e in enumerate(events) if isinstance(e, Interrupted)]
    replies = "".join(e.text_delta for e in events if isinstance(e, ReplyText))
    told = story(events)
    assert interrupted, f"speech over the reply interrupts it; said {replies!r}: {told}"
    for index in interrupted:
        event = events[index]
        turn = event.turn_index
        assert not any(isinstance(e, ReplyAudio) and e.turn_index == turn for e in events[index:]), (
            f"audio after: {told}"
        )
        reply_text = "".join(e.text_delta for e in events if isinstance(e, ReplyText) and e.turn_index == turn)
        assert len(event.spoken_text) < len(reply_text), f"the reply was cut short: {told}"
        assert event.continued == (not event.spoken_text), f"a reply none of which was heard continues the turn: {told}"
    session_id = next(e.session_id for e in events if type(e).__name__ == "Started")
    history = gateway.servicer.history(session_id)
    lines = [(entry.role, entry.text, entry.interrupted) for entry in history]
    # The interrupted replies as far as they were heard, marked as cut short; none for a reply nobody heard a word of.
    cut_short = [(entry.text, entry.interrupted) for entry in history if entry.interrupted]
    spoken = [(events[i].spoken_text, True) for i in interrupted if events[i].spoken_text]
    assert cut_short == spoken, f"only what was heard, marked as cut short: {lines} {told}"
    heard_whole = [entry for entry in history if entry.role == "assistant" and not entry.interrupted]
    assert all(entry.text.strip() for entry in heard_whole), "replies heard in full are kept whole"
    # Each committed turn is a user line, but one a reply nobody heard a word of was cut in: that turn goes on in the
    # next line.
    committed = sum(1 for e in events if isinstance(e, UserTranscript) and e.final)
    continued = sum(events[i].continued for i in interrupted)
    assert sum(entry.role == "user" for entry in history) == committed - continued, f"{lines} {told}"
    assert any("wizard" in t.user_text.lower() for t in turns), f"the interruption became the next turn: {told}"
    # The wizard sentence pauses at its comma. A reply started in that pause and cut before a word of it was heard
    # leaves the sentence whole in one user line; apart, only with some of the reply heard in between.
    for position, entry in enumerate(history):
        if entry.role == "user" and "vanish" in entry.text.lower() and "wizard" not in entry.text.lower():
            assert position and history[position - 1].interrupted, f"the sentence continued: {lines} {told}"


def story(events: list) -> list[str]:
    """The session's events in short, one line per user turn, reply and interruption: for failure messages."""
    lines: list[str] = []
    for event in events:
        if isinstance(event, UserTranscript) and event.final:
            lines.append(f"{event.turn_index} user {event.text!r}")
        elif isinstance(event, ReplyDone):
            lines.append(f"{event.turn_index} reply {event.text!r}")
        elif isinstance(event, Interrupted):
            continued = " (the turn goes on)" if event.continued else ""
            lines.append(f"{event.turn_index} interrupted after {event.spoken_text!r}{continued}")
        elif isinstance(event, TurnMetrics):
            server = event.server
            lines.append(
                f"{event.turn_index} hangover {server.hangover_ms} ms, P(turn end) {server.turn_end_probability:.2f}"
            )
    return lines


# The question both the barge-in and the backchannel test ask: the embedded model answers it at length (54-102
# characters however the ASR writes it, ~4-6 s of speech), so the reply is still playing when the user speaks.
QUESTION = "Can you tell me a long story about a dragon?"
QUESTION_WORDS = ("story", "dragon")


async def speech_of(services: dict[str, str], text: str, heard_as: tuple[str, ...] = ()) -> Clip:
    """`text` read by Piper with its noise at 0 (`harness.clips.spoken`: the same samples in every run and every
    process; no human backchannel recording is shipped), and the ASR service hears each of `heard_as` in it.

    The clip starts with 0.3 s of silence, as a speaker's does: with no silence before "Can you" the ASR heard
    "tell me along, story" in 8 of 12 of Piper's noisy readings. A reading the ASR mishears would fail every run
    alike, and says so here rather than as a missing interruption."""
    clip = spoken(text)
    heard = re.findall(r"[a-z]+", (await transcribe(services, float_to_pcm16(clip.samples))).lower())
    assert all(word in heard for word in heard_as), f"the ASR does not hear {heard_as} in Piper's {text!r}: {heard}"
    return clip


async def test_a_backchannel_over_the_reply_lets_it_play_on(services, gateway) -> None:
    """The user says "Yeah." over a long reply, 0.3 s after the reply's first audio reached the client.

    One take, with fixed inputs: the question and the "Yeah." are Piper's noiseless readings
    (`harness.clips.spoken`: the same samples in every run), the question checked once to be heard as asked. The
    "Yeah." is mixed into the frames not yet sent at a fixed offset from the reply's first audio (`AfterFirstAudio`),
    however late the reply starts (a loaded box once started it 1.22 s after the question) and however short it
    is. A failure here is the pipeline's."""
    yeah = await speech_of(services, "Yeah.")
    config = conversation_pb2.SessionConfig(
        system_prompt="A talkative assistant who always answers with three long sentences.",
        options=conversation_pb2.PipelineOptions(max_tokens=120),
    )
    into_reply_s = 0.3
    question = await speech_of(services, QUESTION, QUESTION_WORDS)
    # The stream goes on 5 s past the "Yeah." however late the reply starts, as in the barge-in test.
    trailing_s = 15.0
    then_quiet = Clip(np.zeros(int((yeah.duration_s + 5.0) * 16000), np.float32), 16000)
    turns, _, events = await talk(
        target(gateway),
        question,
        config,
        trailing_silence_s=trailing_s,
        inject=[(AfterFirstAudio(into_reply_s), yeah), (AfterFirstAudio(into_reply_s), then_quiet)],
    )
    # The premise, as in the barge-in test: the question was heard as asked. A mishearing ("Can you? Tell me
    # along.") gets a two-word answer that is over before the "yeah" is, which then is a turn of its own.
    heard_question = [t.user_text for t in turns]
    assert turns and any(word in turns[0].user_text.lower() for word in QUESTION_WORDS), (
        f"the question was misheard: {heard_question}"
    )
    # ... and the reply started while the stream was still being sent, so the "Yeah." went out over it (a "Yeah."
    # never sent would interrupt nothing, and the test would pass on nothing).
    started_s = (turns[0].first_audio_received_us - turns[0].speech_end_sent_us) / 1e6
    assert started_s < trailing_s - 1.0, f"the reply began {started_s:.1f} s after the question, past the stream"
    interrupted = [e for e in events if isinstance(e, Interrupted)]
    heard = [t.user_text for t in turns]
    assert not interrupted, f"a backchannel does not stop the reply: {interrupted}; the user's turns: {heard}"
    assert len(turns) == 1, heard  # and it is not a turn of its own
    turn = turns[0]
    done = [e for e in events if type(e).__name__ == "ReplyDone"]
    assert done and done[0].turn_index == turn.turn_index, "the reply played to its end"
    played_s = (max(e.received_us for e in events if isinstance(e, ReplyAudio)) - turn.first_audio_received_us) / 1e6
    assert played_s > into_reply_s + yeah.duration_s + 0.3, f"the reply stopped {played_s:.1f} s into it"
    history = gateway.servicer.history(next(e.session_id for e in events if type(e).__name__ == "Started"))
    assert [entry.role for entry in history] == ["user", "assistant"] and not history[1].interrupted


async def test_a_pause_mid_sentence_never_speaks_the_speculative_reply(gateway) -> None:
    """jfk.wav pauses ~1.1 s after "Americans": a speculative reply starts there and must be discarded."""
    config = conversation_pb2.SessionConfig(
        options=conversation_pb2.PipelineOptions(
            endpointing=asr_pb2.EndpointingConfig(
                candidate_silence_ms=64, hangover_ms=1500, max_hangover_ms=1500, fixed_hangover=True
            )
        )
    )
    turns, _, events = await talk(target(gateway), load_clip("jfk"), config, trailing_silence_s=3.0)
    assert len(turns) == 1
    final_at = next(i for i, e in enumerate(events) if isinstance(e, UserTranscript) and e.final)
    assert not any(isinstance(e, ReplyText | ReplyAudio) for e in events[:final_at]), "nothing spoken before the commit"
    assert "country" in turns[0].user_text.lower() and "americans" in turns[0].user_text.lower()
    metrics = [e for e in events if isinstance(e, TurnMetrics)]
    assert metrics[0].server.speculative_discarded >= 1


async def _split_after(services: dict[str, str], clip: Clip, word: str, pause_s: float) -> Clip:
    """`clip` with `pause_s` of silence spliced in after `word` (its end as the ASR's word timings put it)."""
    events = [e async for _, e in clients.recognize(services["asr"], clip, realtime=False)]
    words = [w for e in events if e.WhichOneof("event") == "final" for w in e.final.words]
    end_ms = next(w.end_ms for w in words if w.text.strip(".,").lower() == word)
    audio = clip.to_rate(16000).samples
    cut = int(end_ms * 16)
    return join(Clip(audio[:cut], 16000), pause_s, Clip(audio[cut:], 16000))


@pytest.mark.parametrize("fixed", [False, True], ids=["scored-by-the-llm", "fixed-hangover"])
async def test_a_pause_where_whisper_puts_a_full_stop_is_held_open_by_the_llms_score(
    services, gateway, fixed: bool
) -> None:
    """Whisper transcribes "The child almost hurt" with a full stop; Gemma's P(end) after "hurt" is ~0.004. With
    the LLM's score the 600 ms pause is waited out and the sentence is one turn; the fixed hangover (the
    control) cuts it in two."""
    clip = await _split_after(services, load_clip("spk1_snt1"), "hurt", 0.6)
    endpointing = asr_pb2.EndpointingConfig(fixed_hangover=fixed)
    config = conversation_pb2.SessionConfig(options=conversation_pb2.PipelineOptions(endpointing=endpointing))
    turns, _, events = await talk(target(gateway), clip, config, trailing_silence_s=3.0)
    finals = [e.text for e in events if isinstance(e, UserTranscript) and e.final]
    if fixed:
        assert len(finals) == 2, finals
    else:
        assert len(finals) == 1 and "hurt" in finals[0].lower() and "dog" in finals[0].lower(), finals
        assert len(turns) == 1


@pytest.mark.parametrize("fixed", [False, True], ids=["scored", "cut-by-the-fixed-hangover"])
async def test_a_short_sentence_with_a_long_pause_early_in_it_leaves_each_word_once(
    services, gateway, fixed: bool
) -> None:
    """A five-word sentence with a 600 ms pause after its second word: the user's lines in the history hold each word
    once, in order, whether the pause ended a turn (the fixed hangover cuts it) or not. A cut turn that goes on once
    became an eleven-word line: the sentence, its last two words again, then its first words again."""
    sentence = "Please book a quiet table."
    clip = await _split_after(services, await speech_of(services, sentence, ("book", "quiet")), "book", 0.6)
    endpointing = asr_pb2.EndpointingConfig(fixed_hangover=fixed)
    config = conversation_pb2.SessionConfig(options=conversation_pb2.PipelineOptions(endpointing=endpointing))
    _, _, events = await talk(target(gateway), clip, config, trailing_silence_s=3.0)
    history = gateway.servicer.history(next(e.session_id for e in events if type(e).__name__ == "Started"))
    said = re.findall(r"[a-z]+", " ".join(entry.text for entry in history if entry.role == "user").lower())
    # The words after the pause are decoded on their own when the pause ended a turn ("a quiet" may come out as
    # "it quite"): what must hold is one line's worth of words, none twice, both halves there.
    assert len(said) == 5 and len(set(said)) == 5, f"words repeated or lost: {said}"
    assert said[:2] == ["please", "book"] and said[-1] == "table", said


def _config(**fields: object) -> conversation_pb2.ConverseRequest:
    base: dict[str, object] = {"input_sample_rate_hz": 16000}
    base.update(fields)
    return conversation_pb2.ConverseRequest(config=conversation_pb2.SessionConfig(**base))


def _frame(seq: int, data: bytes = b"\x00\x00" * 320) -> conversation_pb2.ConverseRequest:
    return conversation_pb2.ConverseRequest(frame=pcm_frame(data, 16000, seq))


@pytest.mark.parametrize(
    ("messages", "code", "words"),
    [
        ([_config(input_sample_rate_hz=44000)], grpc.StatusCode.INVALID_ARGUMENT, ("input_sample_rate_hz=44000",)),
        ([_config(output_sample_rate_hz=11025)], grpc.StatusCode.INVALID_ARGUMENT, ("output_sample_rate_hz=11025",)),
        ([_frame(0)], grpc.StatusCode.FAILED_PRECONDITION, ("first message", "SessionConfig")),
        ([_config(), _frame(0), _config()], grpc.StatusCode.FAILED_PRECONDITION, ("second SessionConfig",)),
        ([_config(), _frame(0, b"\x00" * 3)], grpc.StatusCode.INVALID_ARGUMENT, ("odd",)),
        ([_config(), _frame(0), _frame(2)], grpc.StatusCode.OUT_OF_RANGE, ("1 frame(s) missing",)),
        (
            [_config(options=conversation_pb2.PipelineOptions(max_tokens=9999))],
            grpc.StatusCode.OUT_OF_RANGE,
            ("options.max_tokens=9999",),
        ),
        ([_config(session_id="x" * 200)], grpc.StatusCode.INVALID_ARGUMENT, ("session_id",)),
        (
            [
                _config(
                    options=conversation_pb2.PipelineOptions(endpointing=asr_pb2.EndpointingConfig(hangover_ms=20000))
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            ("options.endpointing.hangover_ms=20000", "32-10000"),
        ),
        (
            [_config(options=conversation_pb2.PipelineOptions(false_interruption_timeout_ms=50))],
            grpc.StatusCode.OUT_OF_RANGE,
            ("false_interruption_timeout_ms=50", "100-5000"),
        ),
        (
            [_config(options=conversation_pb2.PipelineOptions(backchannels=["x" * 40]))],
            grpc.StatusCode.OUT_OF_RANGE,
            ("backchannels",),
        ),
    ],
)
async def test_bad_input_gets_a_clear_status(gateway, messages, code, words) -> None:
    async with grpc.aio.insecure_channel(target(gateway)) as channel:
        call = conversation_pb2_grpc.ConversationStub(channel).Converse(requests(*messages))
        await expect_error(call, code, *words)


async def test_a_voice_the_tts_refuses_ends_the_session_with_its_reason(services) -> None:
    # A gateway process of its own: the refusal comes from the TTS service a moment after the config, and a
    # client sharing its event loop with an in-process server can see that race as INTERNAL.
    mesh = Mesh()
    process = mesh.start("gateway", free_port(), [f"--{n}-target={services[n]}" for n in ("asr", "llm", "tts")])
    try:
        await mesh.wait()
        async with grpc.aio.insecure_channel(process.target) as channel:
            messages = requests(_config(voice="nobody"), _frame(0), hold=True)
            call = conversation_pb2_grpc.ConversationStub(channel).Converse(messages)
            await expect_error(call, grpc.StatusCode.INVALID_ARGUMENT, "tts", "voice='nobody'", "en_US-joe-medium")
    finally:
        mesh.stop_all()


async def test_a_bad_session_does_not_disturb_a_good_one(gateway) -> None:
    good = asyncio.ensure_future(talk(target(gateway), load_clip("spk2_snt1"), trailing_silence_s=2.0))
    async with grpc.aio.insecure_channel(target(gateway)) as channel:
        stub = conversation_pb2_grpc.ConversationStub(channel)
        for _ in range(3):
            await expect_error(stub.Converse(requests(_config(), _frame(0, b"\x01"))), grpc.StatusCode.INVALID_ARGUMENT)
            call = stub.Converse(requests(_config(), *[_frame(i) for i in range(30)]))
            call.cancel()
    turns, audio, _ = await good
    assert turns and turns[0].reply_text and audio


async def test_tts_killed_and_restarted_mid_session(services) -> None:
    """The session reports the TTS stage failing, then speaks again once TTS is back, without a restart."""
    mesh = Mesh()
    tts = mesh.start("tts", free_port())
    await mesh.wait()
    server = await start_gateway(services["asr"], services["llm"], tts.target)
    question = load_clip("spk2_snt1")
    clip = join(question, 4.0, question, 6.0, question)
    try:

        async def chaos() -> None:
            await asyncio.sleep(question.duration_s + 3.0)  # after the first reply
            mesh.kill("tts")
            await asyncio.sleep(question.duration_s + 3.0)  # the second turn meets a dead TTS
            mesh.restart("tts")

        chaos_task = asyncio.ensure_future(chaos())
        turns, _, events = await talk(target(server), clip, trailing_silence_s=5.0)
        await chaos_task
        errors = [e for e in events if isinstance(e, SessionError)]
        assert any(e.stage == "tts" and e.recoverable for e in errors), errors
        assert len(turns) == 3
        audio_turns = {e.turn_index for e in events if isinstance(e, ReplyAudio)}
        assert turns[0].turn_index in audio_turns and turns[2].turn_index in audio_turns
    finally:
        await server.stop()
        mesh.stop_all()


async def test_a_gateway_with_a_token_refuses_calls_without_it(services) -> None:
    server = build_server(
        GatewaySettings(
            port=0,
            http_port=-1,
            auth_token="s3cret",
            asr_target=services["asr"],
            llm_target=services["llm"],
            tts_target=services["tts"],
        )
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(target(server)) as channel:
            stub = conversation_pb2_grpc.ConversationStub(channel)
            for metadata in (None, (("authorization", "Bearer wrong"),)):
                call = stub.Converse(requests(_config(), hold=True), metadata=metadata)
                await expect_error(call, grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")
            call = stub.Converse(requests(_config(), hold=True), metadata=(("authorization", "Bearer s3cret"),))
            first = await anext(aiter(call))
            assert first.WhichOneof("event") == "started"
            call.cancel()
    finally:
        await server.stop()


async def test_a_flood_faster_than_real_time_is_refused_and_another_session_goes_on() -> None:
    """One client sending 1 s frames as fast as it can: refused at the one that puts it over 2 s ahead of the clock,
    not queued for minutes."""
    server = await start_offline_gateway(http_port=-1)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = conversation_pb2_grpc.ConversationStub(channel)
            calm = stub.Converse(requests(_config(session_id="calm"), hold=True))
            assert (await anext(aiter(calm))).WhichOneof("event") == "started"
            second = b"\x00\x00" * 16000  # 1 s of audio per frame

            async def flood() -> AsyncIterator[conversation_pb2.ConverseRequest]:
                yield _config(session_id="flood")
                # 3 s of audio within ms: past the 2 s the gateway allows ahead of the clock. Then nothing more: a
                # write racing the refusal makes grpcio report INTERNAL "Internal error from Core" instead of the
                # status (grpc/grpc#36066; seen in a `make test` run when this client wrote 60 frames 5 ms apart).
                for seq in range(3):
                    yield conversation_pb2.ConverseRequest(frame=pcm_frame(second, 16000, seq))
                    await asyncio.sleep(0.005)
                await asyncio.Event().wait()  # until the call ends

            await expect_error(stub.Converse(flood()), grpc.StatusCode.RESOURCE_EXHAUSTED, "faster than real time")
            assert "calm" in server.servicer.active and "flood" not in server.servicer.active
            calm.cancel()
    finally:
        await server.stop()


async def test_a_stopping_gateway_lets_the_reply_being_spoken_finish_and_refuses_new_sessions(services) -> None:
    """SIGTERM mid-reply (a rolling update): NOT_SERVING, no new session, the reply plays to its end, then the
    call ends."""
    server = await start_gateway(services["asr"], services["llm"], services["tts"], http_port=-1, drain_grace_s=20)
    target_ = f"127.0.0.1:{server.port}"
    config = conversation_pb2.SessionConfig(input_sample_rate_hz=16000, output_sample_rate_hz=16000)
    frames = load_clip("spk2_snt1").to_rate(16000).frames() + [b"\x00\x00" * 320] * 400
    events: list[object] = []
    stopping: asyncio.Future[None] | None = None
    refusal = ""
    try:
        async with ConversationClient(target_, config, reconnect_attempts=0) as client:

            async def speak() -> None:
                async for _, data in clients.paced(frames):
                    client.send(data)

            speaker = asyncio.ensure_future(speak())
            try:
                async for event in client.events():
                    events.append(event)
                    if isinstance(event, ReplyAudio) and stopping is None:
                        stopping = asyncio.ensure_future(server.stop())
                        await asyncio.sleep(0.2)
                        async with grpc.aio.insecure_channel(target_) as channel:
                            call = conversation_pb2_grpc.ConversationStub(channel).Converse(
                                requests(_config(), hold=True)
                            )
                            refusal = await expect_error(call, grpc.StatusCode.UNAVAILABLE, "reach another replica")
            except grpc.aio.AioRpcError:
                pass  # the call is cut once the drain is over
            finally:
                speaker.cancel()
        assert stopping is not None, "a reply started"
        await asyncio.wait_for(stopping, 30)
        assert refusal
        done = [event for event in events if isinstance(event, ReplyDone)]
        assert done and done[0].text, "the reply being spoken when the gateway stopped was played to its end"
        audio_ms = sum(len(e.pcm16) for e in events if isinstance(e, ReplyAudio)) / 32
        assert audio_ms >= 500, audio_ms
    finally:
        if stopping is None:
            await server.stop()
