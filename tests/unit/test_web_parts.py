"""The browser doors' parts without a network: origin policy, frame parsing, event JSON, the WebSocket transport
over the playout, the WebRTC reply track, ICE settings."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from gateway.downlink import DownlinkWatch
from gateway.origins import OriginPolicy
from gateway.playout import Playout
from gateway.protocol import CLOSE_REASON_BYTES, FRAME_HEADER, close_reason, event_message, parse_uplink_frame
from gateway.session import ReplyFrame
from gateway.settings import GatewaySettings
from gateway.webrtc import ReplyTrack, WebRtcOptions, hand_packets_on_at_once, parse_ice_servers
from gateway.websocket import WebSocketTransport
from voicemesh.errors import RequestError
from voicemesh.v1 import audio_pb2, conversation_pb2, tts_pb2


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


@pytest.mark.parametrize("origin", ["http://[::1", "null", "", "not a url"])
def test_an_origin_that_is_not_a_url_is_refused_not_an_error(origin: str) -> None:
    # Found by bench/chaos/fuzz.py: "http://[::1" made urlsplit raise, and /api/offer answered 500.
    with pytest.raises(RequestError) as refused:
        OriginPolicy("").check(origin, "")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_close_reason_is_cut_at_a_character_boundary() -> None:
    # Found by bench/chaos/fuzz.py: a refusal quoting non-ASCII input was cut inside a character, and the page's
    # WebSocket failed with 1007 (invalid UTF-8) instead of reading the reason.
    for text in ("é" * 100, "x" + "\U0001f600" * 40, "ascii " * 30):
        reason = close_reason(text)
        assert len(reason) <= CLOSE_REASON_BYTES and text.startswith(reason.decode())
        assert len(reason) > CLOSE_REASON_BYTES - 4


def test_an_uplink_frame_is_a_header_and_audio_of_any_length() -> None:
    for samples in (960, 128, 441, 1):  # 20 ms at 48 kHz, an AudioWorklet quantum, 10 ms at 44.1 kHz, one sample
        pcm = b"\x01\x00" * samples
        assert parse_uplink_frame(FRAME_HEADER.pack(123, 7) + pcm, 48000) == (123, 7, pcm)
    for short in (b"", FRAME_HEADER.pack(123, 7), FRAME_HEADER.pack(123, 7) + b"\x01"):
        with pytest.raises(RequestError) as refused:
            parse_uplink_frame(short, 48000)
        assert "12-byte header" in refused.value.message and "1920 bytes for 20 ms" in refused.value.message


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


def reply_frame(index: int, pcm16: bytes = b"\x01\x00" * 960, turn_index: int = 0) -> ReplyFrame:
    speech = tts_pb2.SpeechFrame(frame=audio_pb2.AudioFrame(data=pcm16), text=f"word{index}", chunk_end=True)
    return ReplyFrame(turn_index, index, speech)


class FakeWebSocket:
    """What WebSocketTransport uses of aiohttp's WebSocketResponse, recording what was sent."""

    def __init__(self) -> None:
        self.closed = False
        self.sent: list[tuple[str, object]] = []
        self.close_code: int | None = None

    async def send_bytes(self, data: bytes) -> None:
        sent_us, turn_index = FRAME_HEADER.unpack_from(data)
        assert sent_us > 0 and len(data) == FRAME_HEADER.size + 1920
        self.sent.append(("audio", turn_index))

    async def send_str(self, data: str) -> None:
        self.sent.append(("text", json.loads(data)["type"]))

    async def close(self, code: int, message: bytes) -> None:
        self.closed, self.close_code = True, code


async def test_the_websocket_sends_events_at_once_and_audio_from_the_playout_and_a_flush_drops_only_audio() -> None:
    ws = FakeWebSocket()
    played: list[int] = []
    # A pace far slower than the test: the frame due now and the 5-frame lead leave at once, then nothing more.
    playout: Playout[ReplyFrame] = Playout(lambda frame, sent_us: played.append(frame.seq), 30.0, 5)
    transport = WebSocketTransport(ws, playout, DownlinkWatch())
    for index in range(12):
        playout.push(reply_frame(index, turn_index=3))
    while len(ws.sent) < 6:
        await asyncio.sleep(0.01)
    await transport.send_json({"type": "user_partial"})
    assert ws.sent == [("audio", 3)] * 6 + [("text", "user_partial")], "events do not wait behind queued audio"
    assert played == list(range(6)) and playout.queued == 6
    assert playout.flush() == 6
    await transport.send_json({"type": "interrupted"})
    await asyncio.sleep(0.05)
    assert ws.sent[7:] == [("text", "interrupted")], "nothing of the flushed reply follows"
    await transport.close(4409, "taken over")
    assert ws.close_code == 4409
    playout.push(reply_frame(99))
    await asyncio.sleep(0.05)
    assert ws.sent[-1] == ("text", "interrupted"), "a closed transport plays nothing more"


async def test_the_reply_track_takes_a_frame_per_tick_pads_with_silence_pauses_and_flushes() -> None:
    played: list[int] = []
    playout: Playout[ReplyFrame] = Playout(lambda frame, sent_us: played.append(frame.seq))
    track = ReplyTrack(playout, 48000)
    tone = (np.ones(960, np.int16) * 1000).tobytes()
    playout.push(reply_frame(0, tone))
    playout.push(reply_frame(1, tone))
    playout.push(reply_frame(2, tone[:960]))  # half a frame: padded with silence
    frames = [await track.recv() for _ in range(4)]
    samples = [frame.to_ndarray().reshape(-1) for frame in frames]
    assert all(frame.samples == 960 and frame.sample_rate == 48000 for frame in frames)
    assert [int(np.count_nonzero(s)) for s in samples] == [960, 960, 480, 0]
    assert frames[1].pts - frames[0].pts == 960
    assert played == [0, 1, 2]
    for index in range(3, 6):
        playout.push(reply_frame(index, tone))
    playout.pause()
    assert not np.any((await track.recv()).to_ndarray()), "silence while paused"
    playout.resume()
    assert np.count_nonzero((await track.recv()).to_ndarray()) == 960
    assert played == [0, 1, 2, 3], "resumed with the frame it paused at"
    assert playout.flush() == 2
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


async def test_the_microphones_packets_are_decoded_as_each_arrives_and_a_lost_one_holds_nothing_up() -> None:
    from aiortc import RTCPeerConnection
    from aiortc.rtp import RtpPacket

    def packet(seq: int) -> RtpPacket:
        made = RtpPacket(payload_type=111, sequence_number=seq, timestamp=960 * seq, payload=b"x")
        made._data = bytes([seq])  # type: ignore[attr-defined]  # what aiortc's receiver sets: the depacketized frame
        return made

    def handed_on(receiver: object, arriving: list[int]) -> list[list[int]]:
        """The frames (by sequence number) handed to the decoder as each packet arrives."""
        buffer = receiver._RTCRtpReceiver__jitter_buffer  # type: ignore[attr-defined]
        handed = []
        for seq in arriving:
            _, frame = buffer.add(packet(seq))
            handed.append([] if frame is None else [frame.data[0]])
        return handed

    pc = RTCPeerConnection()
    try:
        default, ours, lossy, reordered = (pc.addTransceiver("audio").receiver for _ in range(4))
        for receiver in (ours, lossy, reordered):
            hand_packets_on_at_once(receiver)
        control = handed_on(default, list(range(8)))
        assert control.index([0]) == 4, "aiortc's own receiver waits for 4 more packets (the control)"
        assert handed_on(ours, list(range(6))) == [[0], [1], [2], [3], [4], [5]], "each packet at once"
        # Packet 2 never comes: nothing waits for it past two later packets, and no packet is handed on twice.
        assert handed_on(lossy, [0, 1, 3, 4, 5, 6]) == [[0], [1], [], [3], [4], [5]]
        # Packet 2 comes after 3: both are heard, in order.
        assert handed_on(reordered, [0, 1, 3, 2, 4, 5]) == [[0], [1], [], [2], [3], [4]]
    finally:
        await pc.close()
