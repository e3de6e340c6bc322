"""Session orchestration with fake backends: what reaches the ASR stream, and what the reply's playout is told
(hand-over, interruption, pause and resume) as the transport plays it."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from gateway.options import PipelineOptions, SessionOptions, resolve
from gateway.session import HistoryEntry, ReplyFrame, Session, trim_history
from tests.unit.fake_backends import FRAMES_PER_WORD, FakeBackends, until
from voicemesh import telemetry
from voicemesh.errors import RequestError
from voicemesh.v1 import asr_pb2, audio_pb2, conversation_pb2, llm_pb2, tts_pb2


def new_session(backends: FakeBackends, **options: Any) -> Session:
    session_options = SessionOptions("s1", 16000, 16000, "", "", PipelineOptions(**options))
    return Session(session_options, backends, history=[])  # type: ignore[arg-type]  # FakeBackends fakes the streams


def drain(session: Session) -> list[tuple[str, conversation_pb2.ConverseEvent]]:
    events = []
    while not session.events.empty():
        event = session.events.get_nowait()
        assert isinstance(event, conversation_pb2.ConverseEvent)
        events.append((event.WhichOneof("event") or "", event))
    return events


async def play(session: Session, frames: int) -> list[ReplyFrame]:
    """Play `frames` frames of the reply as a transport does: each when the playout lets it go."""
    played: list[ReplyFrame] = []
    while len(played) < frames:
        frame = session.playout.take()
        if frame is None:
            await asyncio.sleep(0.005)
        else:
            played.append(frame)
    return played


async def committed_reply(reply: str, **options: object) -> tuple[Session, FakeBackends]:
    """A session whose user asked something and whose reply is committed and synthesized, nothing played yet."""
    backends = FakeBackends(reply=reply)
    session = new_session(backends, **options)
    await until(lambda: backends.tts_connected)
    backends.say(speech_started=asr_pb2.SpeechStarted())
    backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="what time is it"))
    backends.say(final=asr_pb2.Final(text="what time is it"))
    await until(lambda: session.playout.queued == len(reply.split()) * FRAMES_PER_WORD)
    return session, backends


async def test_frames_sent_while_the_asr_stream_connects_are_not_lost() -> None:
    backends = FakeBackends(connect_s=0.1)
    session = new_session(backends)
    for index in range(10):  # 200 ms of audio before the ASR stream is up
        session.push_frame(audio_pb2.AudioFrame(data=bytes([index]) * 640, seq=index, capture_time_us=1000 + index))
    await asyncio.sleep(0.2)
    for index in range(10, 15):
        session.push_frame(audio_pb2.AudioFrame(data=bytes([index]) * 640, seq=index, capture_time_us=1000 + index))
    await asyncio.wait_for(session.finish(), 5)
    await session.close()
    requests = [r for r in backends.asr if isinstance(r, asr_pb2.RecognizeRequest)]
    assert requests[0].WhichOneof("request") == "config"
    frames = [r.frame for r in requests[1:]]
    assert [f.seq for f in frames] == list(range(15))
    assert [f.data[0] for f in frames] == list(range(15))  # in order, none lost
    assert [f.capture_time_us for f in frames] == [1000 + i for i in range(15)]
    assert isinstance(backends.tts[0], tts_pb2.SynthesizeRequest)


async def test_partials_prefill_the_dialogue_one_call_at_a_time_and_a_failed_prefill_loses_nothing() -> None:
    backends = FakeBackends(reply="Yes it is.")
    session = new_session(backends)
    try:
        await until(lambda: backends.tts_connected)
        before = telemetry.PREFILLS.labels("failed")._value.get()
        backends.prefill_error = grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "replica down"
        )
        backends.say(speech_started=asr_pb2.SpeechStarted())
        backends.say(partial=asr_pb2.Partial(text="is it going"))
        await until(lambda: len(backends.prefills) == 1)
        assert telemetry.PREFILLS.labels("failed")._value.get() == before + 1
        backends.prefill_error = None
        backends.say(partial=asr_pb2.Partial(text="is it going to"))
        await until(lambda: len(backends.prefills) == 2)
        request = backends.prefills[-1]
        assert request.session_id == "s1" and request.messages[-1].content == "is it going to"
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="is it going to rain"))
        backends.say(final=asr_pb2.Final(text="is it going to rain"))
        await until(lambda: session.playout.queued == 3 * FRAMES_PER_WORD)  # the reply, whatever the prefills did
        backends.say(speech_started=asr_pb2.SpeechStarted())
        backends.say(partial=asr_pb2.Partial(text="yeah okay sure"))  # a backchannel: the reply is current still
        await asyncio.sleep(0.05)
        assert len(backends.prefills) == 2
    finally:
        await session.close()


async def test_without_prefill_partials_no_prefill_is_sent() -> None:
    backends = FakeBackends()
    session = new_session(backends, prefill_partials=False)
    try:
        await until(lambda: backends.tts_connected)
        backends.say(speech_started=asr_pb2.SpeechStarted())
        backends.say(partial=asr_pb2.Partial(text="is it going to"))
        backends.say(final=asr_pb2.Final(text="is it going to rain"))
        await until(lambda: session.playout.queued > 0)
        assert backends.prefills == []
    finally:
        await session.close()


async def test_the_reply_is_handed_to_the_playout_and_is_done_only_once_the_transport_played_it() -> None:
    session, _ = await committed_reply("Hello there friend.")
    try:
        events = drain(session)
        kinds = [kind for kind, _ in events]
        assert kinds[0] == "user_final" and set(kinds[1:]) == {"reply_text"}, "no audio among the events"
        frames = await play(session, 2 * FRAMES_PER_WORD)
        assert [(f.turn_index, f.seq) for f in frames] == [(0, i) for i in range(2 * FRAMES_PER_WORD)]
        assert drain(session) == [], "not done while audio is still queued"
        await play(session, FRAMES_PER_WORD)
        events = drain(session)
        assert [kind for kind, _ in events] == ["reply_done", "metrics"]
        assert events[0][1].reply_done.text == "Hello there friend."
        metrics = events[1][1].metrics
        assert metrics.reply_audio_ms == 3 * FRAMES_PER_WORD * 20 and metrics.first_audio_sent_us > 0
        assert [(e.role, e.text, e.interrupted) for e in session.history] == [
            ("user", "what time is it", False),
            ("assistant", "Hello there friend.", False),
        ]
    finally:
        await session.close()


async def test_an_interruption_drops_the_queued_audio_at_once_and_keeps_only_what_was_heard() -> None:
    session, backends = await committed_reply("One two three four five six.")
    try:
        await play(session, 2 * FRAMES_PER_WORD)  # "One two" was heard
        drain(session)
        backends.say(partial=asr_pb2.Partial(text="no wait"))
        await until(lambda: not session.events.empty())
        assert session.playout.queued == 0 and session.playout.take() is None, "nothing more of the reply leaves"
        events = drain(session)
        assert events[0][0] == "user_partial" and events[1][0] == "interrupted"
        assert events[1][1].interrupted.spoken_text == "One two"
        assert session.history[-1].text == "One two" and session.history[-1].interrupted
    finally:
        await session.close()


async def test_words_before_any_of_the_reply_was_heard_continue_the_users_turn_in_one_history_line() -> None:
    session, backends = await committed_reply("One two three four five six.")
    try:
        await play(session, FRAMES_PER_WORD - 1)  # a sound of the reply, but not one word of it whole
        drain(session)
        backends.say(partial=asr_pb2.Partial(text="in London"))
        await until(lambda: session.history == [])  # the cut turn's words wait for the rest
        interrupted = [event.interrupted for kind, event in drain(session) if kind == "interrupted"]
        assert [(i.spoken_text, i.continued) for i in interrupted] == [("", True)]
        assert session.playout.queued == 0 and session.playout.take() is None, "nothing more of the reply leaves"
        backends.say(final=asr_pb2.Final(text="in London?"))
        await until(lambda: session.playout.queued > 0)
        finals = [event.user_final.text for kind, event in drain(session) if kind == "user_final"]
        assert finals == ["what time is it in London?"]
        assert [(e.role, e.text) for e in session.history] == [("user", "what time is it in London?")]
    finally:
        await session.close()


async def test_a_reply_started_on_the_final_has_the_users_words_once_in_its_prompt() -> None:
    # No speculative start: the reply starts and is committed at once, and the commit puts the words in the history
    # before the LLM call goes out. They were in its prompt twice, and the model answered by repeating them.
    backends = FakeBackends(reply="It is noon.")
    session = new_session(backends, speculative_start=False)
    try:
        await until(lambda: backends.tts_connected)
        backends.say(final=asr_pb2.Final(text="what time is it"))
        await until(lambda: len(backends.generates) == 1)
        assert [(m.role, m.content) for m in backends.generates[0].messages] == [(llm_pb2.ROLE_USER, "what time is it")]
        assert [(e.role, e.text) for e in session.history] == [("user", "what time is it")]
    finally:
        await session.close()


async def test_a_pause_holds_the_audio_and_the_resume_plays_on_from_where_it_paused() -> None:
    session, backends = await committed_reply(
        "One two three four.", barge_in_min_speech_ms=50, false_interruption_timeout_ms=100
    )
    try:
        await play(session, FRAMES_PER_WORD)
        backends.say(speech_started=asr_pb2.SpeechStarted())  # over the reply, and no words come: a cough
        await until(lambda: session.playout.paused)
        assert session.playout.take() is None and session.playout.queued == 3 * FRAMES_PER_WORD
        await until(lambda: not session.playout.paused)
        frames = await play(session, 3 * FRAMES_PER_WORD)
        assert [f.seq for f in frames] == list(range(FRAMES_PER_WORD, 4 * FRAMES_PER_WORD)), "on from where it paused"
        events = drain(session)
        assert [kind for kind, _ in events][-2:] == ["reply_done", "metrics"]
        assert "interrupted" not in [kind for kind, _ in events]
        assert session.history[-1].text == "One two three four." and not session.history[-1].interrupted
    finally:
        await session.close()


async def test_text_sent_to_the_tts_says_how_much_audio_the_listener_has_left_once_the_reply_plays() -> None:
    session, backends = await committed_reply("One two three four.")
    try:
        deltas = [r.text for r in backends.tts if isinstance(r, tts_pb2.SynthesizeRequest) and r.HasField("text")]
        assert deltas and not any(d.HasField("playout_ahead_ms") for d in deltas), "not playing yet: unset"
        await play(session, FRAMES_PER_WORD)
        reply = session._current
        assert reply is not None
        more = session.tts.delta(reply, " five")
        # Three words queued and the lead sent ahead: at least the queue's audio, at most the lead's more.
        queued_ms = 3 * FRAMES_PER_WORD * 20
        assert queued_ms <= more.playout_ahead_ms <= queued_ms + 5 * 20 + 20
        session.playout.pause()
        assert not session.tts.delta(reply, " six").HasField("playout_ahead_ms"), "paused: no deadline to keep"
    finally:
        await session.close()


def urgencies(backends: FakeBackends) -> list[int]:
    return [
        r.urgency.partials for r in backends.asr if isinstance(r, asr_pb2.RecognizeRequest) and r.HasField("urgency")
    ]


async def test_the_asrs_partials_are_urgent_while_speech_over_the_reply_waits_on_their_words() -> None:
    session, backends = await committed_reply("One two three four five six.")
    try:
        await play(session, FRAMES_PER_WORD)
        assert urgencies(backends) == [], "no speech over the reply: captions, the stream's default"
        backends.say(speech_started=asr_pb2.SpeechStarted())
        await until(lambda: urgencies(backends) == [asr_pb2.PARTIAL_URGENCY_DECISION])
        backends.say(partial=asr_pb2.Partial(text="no wait"))  # words: a real interruption
        await until(lambda: len(urgencies(backends)) == 2)
        assert urgencies(backends)[-1] == asr_pb2.PARTIAL_URGENCY_CAPTIONS, "decided: captions again"
        assert "interrupted" in [kind for kind, _ in drain(session)]
    finally:
        await session.close()


def turn_scores(backends: FakeBackends) -> list[asr_pb2.TurnScore]:
    return [r.turn_score for r in backends.asr if isinstance(r, asr_pb2.RecognizeRequest) and r.HasField("turn_score")]


async def test_the_llms_turn_end_score_goes_back_to_the_asr_pause_it_scores() -> None:
    backends = FakeBackends(turn_end=0.004)
    session = new_session(backends)
    try:
        await until(lambda: bool(backends.asr))
        config = backends.asr[0].config
        assert config.turn_scores, "the ASR is told that every pause will be scored"
        backends.say(speech_started=asr_pb2.SpeechStarted())
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="the child almost hurt.", pause_id=3))
        await until(lambda: bool(turn_scores(backends)))
        (score,) = turn_scores(backends)
        assert score.pause_id == 3 and score.probability == pytest.approx(0.004) and not score.declined
    finally:
        await session.close()


async def test_a_second_pause_with_the_same_words_gets_the_running_replys_score() -> None:
    backends = FakeBackends(turn_end=0.7)
    session = new_session(backends)
    try:
        await until(lambda: bool(backends.asr))
        backends.say(speech_started=asr_pb2.SpeechStarted())
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="what time is it", pause_id=1))
        await until(lambda: len(turn_scores(backends)) == 1)
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="what time is it", pause_id=2))
        await until(lambda: len(turn_scores(backends)) == 2)
        assert [(s.pause_id, round(s.probability, 2), s.declined) for s in turn_scores(backends)] == [
            (1, 0.7, False),
            (2, 0.7, False),
        ]
    finally:
        await session.close()


async def speaking(reply: str = "Hello there friend.") -> tuple[Session, FakeBackends]:
    """A session whose user is saying "what time is it": words the LLM's prefill scores a finished turn (P 0.7; a
    reply asked to score its own words says 0.2)."""
    backends = FakeBackends(reply=reply, turn_end=0.2)
    backends.prefill_turn_end = 0.7
    session = new_session(backends)
    await until(lambda: bool(backends.asr))
    backends.say(speech_started=asr_pb2.SpeechStarted())
    backends.say(partial=asr_pb2.Partial(text="what time is it"))
    return session, backends


async def test_a_candidate_whose_words_a_prefill_scored_takes_that_score_at_once() -> None:
    session, backends = await speaking()
    try:
        await until(lambda: len(backends.prefills) == 1)
        assert backends.prefills[0].messages[-1].content == "what time is it", "every word, the last too"
        await asyncio.sleep(0.02)  # the prefill's answer is in
        # Whisper's question mark is not one of the words scored: the prefill's score stands for this candidate.
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="what time is it?", pause_id=4))
        await until(lambda: bool(turn_scores(backends)) and bool(backends.generates))
        assert [(s.pause_id, round(s.probability, 2)) for s in turn_scores(backends)] == [(4, 0.7)]
        assert not backends.generates[0].score_turn_end, "the reply is not asked to score it again"
        # Other words: the pause waits for their reply's own score.
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="what time is it in Paris", pause_id=5))
        await until(lambda: len(turn_scores(backends)) == 2)
        assert [(s.pause_id, round(s.probability, 2)) for s in turn_scores(backends)][-1] == (5, 0.2)
        assert backends.generates[-1].score_turn_end
    finally:
        await session.close()


async def test_a_reply_started_on_a_finished_sounding_partial_is_the_one_the_turn_commits() -> None:
    used = telemetry.SPECULATIVE.labels("used", "partial")
    before = used._value.get()
    session, backends = await speaking("It is noon.")
    try:
        # The prefill says the words sound finished: the reply starts while the user may still be speaking.
        await until(lambda: len(backends.generates) == 1)
        assert backends.generates[0].messages[-1].content == "what time is it"
        assert not backends.generates[0].score_turn_end, "the prefill scored these words"
        assert turn_scores(backends) == [], "no pause to score yet"
        assert session.playout.queued == 0, "unheard until the turn commits"
        # The speech stops; the draft has the same words: the pause gets the prefill's score at once, no new reply.
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="What time is it?", pause_id=3))
        await until(lambda: bool(turn_scores(backends)))
        assert [(s.pause_id, round(s.probability, 2)) for s in turn_scores(backends)] == [(3, 0.7)]
        backends.say(final=asr_pb2.Final(text="What time is it?"))
        await until(lambda: session.playout.queued == 3 * FRAMES_PER_WORD)
        assert len(backends.generates) == 1, "the reply started on the partial is the one heard"
        assert used._value.get() == before + 1
        assert [(e.role, e.text) for e in session.history] == [("user", "What time is it?")]
    finally:
        await session.close()


async def test_a_reply_started_on_a_partial_writes_its_first_words_then_the_rest_once_a_pause_has_its_words() -> None:
    reply = "It is noon here in the old town square."
    session, backends = await speaking(reply)
    try:
        await until(lambda: len(backends.generates) == 1)
        # Only about the words the TTS's first chunk needs (2 words: 6 tokens) until its words are confirmed: the
        # rest would decode on the cores the ASR's draft of the pause needs.
        assert backends.generates[0].max_tokens == 6
        await asyncio.sleep(0.05)
        assert len(backends.generates) == 1, "nothing more before a pause has its words"
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="What time is it?", pause_id=3))
        await until(lambda: len(backends.generates) == 2)
        rest = backends.generates[1]
        assert rest.reply_prefix == "It is noon here in the" and rest.max_tokens == 48 - 6
        assert not rest.score_turn_end
        backends.say(final=asr_pb2.Final(text="What time is it?"))
        await until(lambda: session.playout.queued == len(reply.split()) * FRAMES_PER_WORD)
        await play(session, len(reply.split()) * FRAMES_PER_WORD)
        await until(lambda: not session.events.empty())
        done = [event for kind, event in drain(session) if kind in ("reply_done", "metrics")]
        assert done[0].reply_done.text == reply, "the whole reply, each word once"
        assert done[1].metrics.completion_tokens == 9 and done[1].metrics.prompt_tokens == 20
        assert done[1].metrics.started_on_partial and done[1].metrics.speculative_used
        # Its score came from the partial's prefill, before the end of speech (0.1: before; 0: never).
        assert done[1].metrics.turn_end_from_prefill and round(done[1].metrics.turn_score_ms, 3) == 0.1
    finally:
        await session.close()


def test_a_session_may_turn_off_starting_replies_on_partials() -> None:
    def policy(**options: bool) -> bool:
        config = conversation_pb2.SessionConfig(
            input_sample_rate_hz=16000, options=conversation_pb2.PipelineOptions(**options)
        )
        return resolve(config, "s1").pipeline.turn_policy().start_on_partials

    assert policy() and policy(start_on_partials=True)
    assert not policy(start_on_partials=False)


async def test_a_reply_started_on_a_partial_is_cancelled_and_never_heard_when_the_user_goes_on() -> None:
    session, backends = await speaking("It is noon.")
    try:
        await until(lambda: len(backends.generates) == 1)
        discarded = telemetry.SPECULATIVE.labels("discarded", "partial")
        before = discarded._value.get()
        backends.prefill_turn_end = 0.1
        backends.say(partial=asr_pb2.Partial(text="what time is it in Paris"))
        await until(lambda: len(backends.prefills) == 2)  # the new words go to the LLM: the reply was cancelled
        assert backends.prefills[-1].messages[-1].content == "what time is it in Paris"
        assert discarded._value.get() == before + 1
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="What time is it in Paris?", pause_id=4))
        await until(lambda: len(backends.generates) == 2)
        assert backends.generates[1].messages[-1].content == "What time is it in Paris?"
        backends.say(final=asr_pb2.Final(text="What time is it in Paris?"))
        await until(lambda: session.playout.queued == 3 * FRAMES_PER_WORD)
        await asyncio.sleep(0.05)
        assert session.playout.queued == 3 * FRAMES_PER_WORD, "only the reply to the whole turn is heard"
        assert [(e.role, e.text) for e in session.history] == [("user", "What time is it in Paris?")]
    finally:
        await session.close()


async def test_a_pause_no_reply_is_started_for_is_declined_at_once() -> None:
    backends = FakeBackends(turn_end=0.5)
    session = new_session(backends, speculative_start=False)
    try:
        await until(lambda: bool(backends.asr))
        assert not backends.asr[0].config.turn_scores, "no speculative reply: nothing scores the pauses"
    finally:
        await session.close()
    backends = FakeBackends(turn_end=0.5)
    session = new_session(backends)
    try:
        await until(lambda: bool(backends.asr))
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="", pause_id=2))  # no words: no reply
        await until(lambda: bool(turn_scores(backends)))
        assert [(s.pause_id, s.declined) for s in turn_scores(backends)] == [(2, True)]
    finally:
        await session.close()


async def test_an_llm_that_cannot_score_is_learnt_and_the_asr_stops_waiting() -> None:
    backends = FakeBackends()  # no turn_end in its replies, as vLLM
    session = new_session(backends)  # not known yet: the session starts out expecting scores
    try:
        await until(lambda: bool(backends.asr))
        assert backends.asr[0].config.turn_scores
        backends.say(speech_started=asr_pb2.SpeechStarted())
        backends.say(endpoint_candidate=asr_pb2.EndpointCandidate(text="what time is it", pause_id=1))
        await until(lambda: bool(turn_scores(backends)))
        assert [(s.pause_id, s.declined) for s in turn_scores(backends)] == [(1, True)]
        assert not session.turns.scorer_available
    finally:
        await session.close()


def test_the_history_keeps_the_latest_turns_within_its_budget_and_drops_half_at_once() -> None:
    history = [
        HistoryEntry("user" if index % 2 == 0 else "assistant", f"{index:03d}" + "x" * 96) for index in range(200)
    ]
    trim_history(history, max_chars=3000)  # 100 turns of 200 characters: 20000 characters
    assert sum(len(entry.text) for entry in history) <= 1500
    assert history[0].role == "user" and history[-1].text.startswith("199"), "the latest turns, whole"
    kept = list(history)
    history += [HistoryEntry("user", "a" * 100), HistoryEntry("assistant", "b" * 100)]
    trim_history(history, max_chars=3000)
    assert history[: len(kept)] == kept, "within the budget nothing moves, so the prompt's prefix stays cached"


async def test_a_session_task_that_fails_unexpectedly_ends_the_session_with_an_error_naming_its_stage() -> None:
    backends = FakeBackends()
    session = new_session(backends)
    backends.asr_script.put_nowait(object())  # not a RecognizeEvent: handling it raises, as a bug would
    items = []
    while not any(isinstance(item, RequestError) for item in items):
        items.append(await asyncio.wait_for(session.events.get(), 5))
    errors = [
        item.error for item in items if isinstance(item, conversation_pb2.ConverseEvent) and item.HasField("error")
    ]
    assert errors and errors[-1].stage == "asr" and errors[-1].code == "INTERNAL" and not errors[-1].recoverable
    assert items[-1].code == grpc.StatusCode.INTERNAL and "asr stage failed" in items[-1].message
    await session.close()


async def test_a_clients_report_of_its_own_hops_goes_into_the_stage_histogram_and_one_out_of_order_does_not() -> None:
    def total_ms(stage: str) -> float:
        return telemetry.TURN_STAGE.labels(stage)._sum.get() * 1000

    session, _ = await committed_reply("Hello there friend.")
    try:
        await play(session, 3 * FRAMES_PER_WORD)
        (metrics,) = [event.metrics for kind, event in drain(session) if kind == "metrics"]
        reply = session.recorder.recent[0]
        capture_us, sent_us = metrics.speech_end_capture_us, metrics.first_audio_sent_us
        reply.receipt_us = capture_us + 30_000  # the last speech frame reached the gateway 30 ms after its capture
        before = {stage: total_ms(stage) for stage in ("downlink", "playout", "capture_to_sent", "sent_to_gateway")}
        session.on_client_report(conversation_pb2.ClientReport(turn_index=0, first_audio_received_us=sent_us + 2_000))
        session.on_client_report(
            conversation_pb2.ClientReport(
                turn_index=0, first_audio_played_us=sent_us + 62_000, speech_end_frame_sent_us=capture_us + 21_000
            )
        )
        added = {stage: round(total_ms(stage) - ms, 3) for stage, ms in before.items()}
        assert added == {"downlink": 2.0, "playout": 60.0, "capture_to_sent": 21.0, "sent_to_gateway": 9.0}

        # A send time after the gateway's receipt is another clock (or another turn): left out, not a negative hop.
        session.on_client_report(
            conversation_pb2.ClientReport(turn_index=0, speech_end_frame_sent_us=reply.receipt_us + 5_000)
        )
        assert total_ms("sent_to_gateway") - before["sent_to_gateway"] == pytest.approx(9.0)
    finally:
        await session.close()
