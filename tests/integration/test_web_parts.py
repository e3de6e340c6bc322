"""The browser doors' parts without a network: origin policy, frame parsing, event JSON, pacing, the reply track."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from gateway.server import GatewaySettings
from gateway.web import FRAME_HEADER, OriginPolicy, PacedDownlink, event_message, parse_uplink_frame
from gateway.webrtc import ReplyTrack, WebRtcOptions, parse_ice_servers
from voicemesh.errors import RequestError
from voicemesh.v1 import conversation_pb2


def test_origin_policy_allows_its_own_page_the_configured_ones_and_non_browsers() -> None:
    policy = OriginPolicy("https://app.example.com/, http://localhost:3000")
    policy.check("http://localhost:8080", "localhost:8080")
    policy.check("https://app.example.com", "gateway.internal:8080")
    policy.check("http://localhost:3000", "localhost:8080")
    policy.check(None, "localhost:8080")
    with pytest.raises(RequestError) as refused:
        policy.check("https://evil.example", "localhost:8080")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "https://evil.example" in refused.value.message and "--allowed-origins" in refused.value.message
    OriginPolicy("*").check("https://anyone.example", "localhost:8080")


def test_an_uplink_frame_must_be_a_header_and_20_ms_of_audio() -> None:
    pcm = b"\x01\x00" * 960
    assert parse_uplink_frame(FRAME_HEADER.pack(123, 7) + pcm, 48000) == (123, 7, pcm)
    with pytest.raises(RequestError) as refused:
        parse_uplink_frame(FRAME_HEADER.pack(123, 7) + pcm[:100], 48000)
    assert "1920 bytes" in refused.value.message and "48000 Hz" in refused.value.message
    with pytest.raises(RequestError, match="640 bytes"):
        parse_uplink_frame(pcm, 16000)


def test_events_become_flat_json_with_every_field_and_exact_microseconds() -> None:
    metrics = conversation_pb2.TurnMetrics(v2v_ms=512.5, first_audio_sent_us=1_790_000_000_123_456)
    metrics.asr_compute_ms = 80
    message = event_message(conversation_pb2.ConverseEvent(turn_index=3, metrics=metrics))
    assert message["type"] == "metrics" and message["turn_index"] == 3
    assert message["first_audio_sent_us"] == 1_790_000_000_123_456
    assert message["asr_compute_ms"] == 80 and message["llm_first_token_ms"] == 0
    assert json.loads(json.dumps(message)) == message
    partial = event_message(conversation_pb2.ConverseEvent(user_partial=conversation_pb2.Transcript(text="the child")))
    assert partial == {"type": "user_partial", "turn_index": 0, "text": "the child", "stable_prefix": ""}


async def test_the_downlink_sends_a_lead_then_paces_and_a_flush_drops_only_audio() -> None:
    sent: list[tuple[str, object]] = []

    async def send(kind: str, payload: object) -> None:
        sent.append((kind, payload))

    # A pace far slower than the test: the frame due now and the 5-frame lead leave at once, then nothing more.
    downlink = PacedDownlink(send, frame_s=30.0, lead_frames=5)
    runner = asyncio.ensure_future(downlink.run())
    try:
        for index in range(12):
            downlink.push("audio", index)
        downlink.push("text", "interrupted")
        downlink.push("text", "metrics")
        while len(sent) < 6:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert sent == [("audio", i) for i in range(6)]
        assert downlink.queued_audio == 6
        assert downlink.flush() == 6
        await asyncio.wait_for(downlink.drain(), 5)
        assert sent[6:] == [("text", "interrupted"), ("text", "metrics")]
    finally:
        runner.cancel()


async def test_the_reply_track_plays_what_it_is_given_then_silence_and_flushes_at_once() -> None:
    track = ReplyTrack(48000)
    tone = (np.ones(960 * 2 + 480, np.int16) * 1000).tobytes()
    track.push(tone)
    assert track.queued_frames == 3
    frames = [await track.recv() for _ in range(4)]
    samples = [frame.to_ndarray().reshape(-1) for frame in frames]
    assert all(frame.samples == 960 and frame.sample_rate == 48000 for frame in frames)
    assert [int(np.count_nonzero(s)) for s in samples] == [960, 960, 480, 0]
    assert frames[1].pts - frames[0].pts == 960
    track.push(tone)
    assert track.flush() == 3 and track.queued_frames == 0
    assert not np.any((await track.recv()).to_ndarray())
    track.stop()


def test_ice_servers_are_checked_once_at_start() -> None:
    servers = parse_ice_servers(
        '[{"urls": "stun:stun.example.org:3478"},'
        ' {"urls": ["turn:turn.example.org:3478"], "username": "u", "credential": "p"}]'
    )
    assert servers == [
        {"urls": ["stun:stun.example.org:3478"]},
        {"urls": ["turn:turn.example.org:3478"], "username": "u", "credential": "p"},
    ]
    with pytest.raises(SystemExit, match="username"):
        parse_ice_servers('[{"urls": "turn:turn.example.org:3478"}]')
    with pytest.raises(SystemExit, match="not JSON"):
        parse_ice_servers("stun:stun.example.org")
    with pytest.raises(SystemExit, match="http://x"):
        parse_ice_servers('[{"urls": "http://x"}]')


def test_ice_host_candidates_follow_the_bind_address() -> None:
    assert WebRtcOptions.from_settings(GatewaySettings()).host_addresses == ["127.0.0.1"]
    assert WebRtcOptions.from_settings(GatewaySettings(host="0.0.0.0")).host_addresses is None
    assert WebRtcOptions.from_settings(GatewaySettings(host="10.1.2.3")).host_addresses == ["10.1.2.3"]
    options = WebRtcOptions.from_settings(GatewaySettings(host="0.0.0.0", ice_host_addresses="10.1.2.3, 10.1.2.4"))
    assert options.host_addresses == ["10.1.2.3", "10.1.2.4"]
