"""The Realtime door's pure parts: replies a client asks for (the turn controller's side), its session settings, and
what a truncate keeps. No models, no network."""

from __future__ import annotations

import base64

import pytest

from gateway.realtime.audio import AudioIn, AudioOut
from gateway.realtime.config import FORMATS, RealtimeConfig, RealtimeProblem
from gateway.realtime.events import Item, RealtimeConversation
from gateway.turn import CommitReply, HoldTurn, Interrupt, StartReply, TurnController, TurnPolicy
from voicemesh import g711


def test_without_replies_on_turns_a_committed_turn_is_held_and_the_client_asks_for_the_reply() -> None:
    controller = TurnController(TurnPolicy(reply_to_turns=False, speculative_start=False))
    controller.on_speech_started(0)
    controller.on_speech_stopped(1000)
    assert controller.on_final(1300, "What time is it?") == [HoldTurn("What time is it?")]
    assert controller.current is None
    assert controller.on_user_text("What time is it?") == [
        StartReply(1, "What time is it?", speculative=False),
        CommitReply(1, "What time is it?", announce=False),
    ]
    assert controller.on_user_text("And the date?") == [], "refused while a reply is current"
    assert controller.on_cancel() == [Interrupt(1)]
    assert controller.current is None and controller.on_cancel() == []


def test_turn_detection_maps_onto_endpointing() -> None:
    config = RealtimeConfig()
    semantic = config.updated({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "low"}}}})
    assert semantic.turn_detection.endpointing().max_hangover_ms == 2400
    assert not semantic.session_config("s").options.endpointing.fixed_hangover
    server = config.updated(
        {"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 700, "threshold": 0.6}}}}
    )
    endpointing = server.session_config("s").options.endpointing
    assert endpointing.fixed_hangover and endpointing.hangover_ms == 700 and abs(endpointing.vad_threshold - 0.6) < 1e-6
    manual = config.updated({"audio": {"input": {"turn_detection": None}}})
    options = manual.session_config("s").options
    assert not manual.turn_detection.replies_on_turns and not options.speculative_start and not options.barge_in
    assert manual.describe("s", "m")["audio"]["input"]["turn_detection"] is None


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"audio": {"input": {"format": {"type": "audio/opus"}}}}, "session.audio.input.format"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format.rate"),
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "x"}}}}, None),
        ({"instructions": "x" * 3000}, "session.instructions"),
        ({"output_modalities": ["audio", "text"]}, "session.output_modalities"),
    ],
)
def test_a_bad_session_update_names_its_field(session: dict[str, object], param: str | None) -> None:
    with pytest.raises(RealtimeProblem) as problem:
        RealtimeConfig().updated(session)
    if param is not None:
        assert problem.value.param == param


def test_g711_formats_run_the_session_at_8_khz() -> None:
    config = RealtimeConfig().updated({"audio": {"input": {"format": {"type": "audio/pcmu"}}}})
    assert config.session_config("s").input_sample_rate_hz == 8000
    config = config.updated({"audio": {"output": {"format": {"type": "audio/pcma"}}}})
    assert config.session_config("s").output_sample_rate_hz == 8000
    audio_in = AudioIn(FORMATS["audio/pcmu"])
    coded = g711.ulaw_encode(bytes(8000 // 50 * 2 * 3))  # 60 ms
    assert [len(frame) for frame in audio_in.frames(base64.b64encode(coded).decode())] == [320, 320, 320]
    audio_out = AudioOut(FORMATS["audio/pcma"])
    assert len(base64.b64decode(audio_out.encode(bytes(8000 // 50 * 2 * 10)))) == 1600  # a byte a sample
    assert audio_out.sent_ms == 200


def test_truncate_keeps_the_chunks_heard_whole() -> None:
    conversation = RealtimeConversation(RealtimeConfig())
    item = Item("item_a", "assistant", "output_audio", text="One two. Three four.", audio_ms=1500)
    item.chunks = [(400.0, "One two."), (1500.0, "Three four.")]
    conversation.items[item.id] = item
    assert conversation.truncate("item_a", 0, 600) == (item, "One two.")
    assert item.status == "incomplete" and item.truncated
    with pytest.raises(RealtimeProblem, match="past the end"):
        conversation.truncate("item_a", 0, 5000)
    with pytest.raises(RealtimeProblem) as unknown:
        conversation.truncate("item_b", 0, 10)
    assert unknown.value.code == "item_not_found"
