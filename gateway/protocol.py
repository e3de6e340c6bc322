"""What the page and the gateway say to each other: the WebSocket protocol of /api/ws, whose JSON messages the WebRTC
data channel carries too.

  page -> gateway   text    first {"type": "start", "config": <SessionConfig as JSON>, "fallback": {...}?};
                            later {"type": "stop"}: the user is done; the last reply plays out, then the socket closes;
                            {"type": "report", "turn_index", "first_audio_received_us"}: the downlink, and later
                            its own hops, "first_audio_played_us" and "speech_end_frame_sent_us" (ClientReport)
                    binary  one frame: 12-byte header <q capture_time_us><I seq> (little-endian, epoch us of the
                            page's clock, seq from 0 without gaps), then PCM16LE mono at input_sample_rate_hz: 20 ms
                            is what the page sends, but any whole number of samples up to 1 s is heard (an
                            AudioWorklet's 128-sample quanta, a client's 10 or 40 ms blocks)
  gateway -> page   text    the Converse events as {"type": <event kind>, "turn_index": n, ...the event's fields},
                            e.g. {"type": "user_partial", "turn_index": 0, "text": "the child", "stable_prefix": ""}
                    binary  reply audio: 12-byte header <q sent_time_us><I turn_index>, then 20 ms of PCM16LE mono
                            at output_sample_rate_hz, paced at real time (a 100 ms lead) and dropped at once on barge-in
  Refusals: an {"type": "error", "code", "message", "recoverable": false} event, then a close with a reason:
  4400 bad request (config, frame size), 4401 no or wrong token, 4403 origin not allowed, 4408 idle or at the
  session's maximum length, 4409 continued on a newer connection, 4429 gateway full or the page not reading its
  messages, 1001 gateway shutting down. /api/offer refuses with an HTTP status and {"error": {...}}.
"""

from __future__ import annotations

import struct
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from voicemesh.audio import samples_per_frame
from voicemesh.errors import RequestError, invalid
from voicemesh.v1 import conversation_pb2

FRAME_HEADER = struct.Struct("<qI")  # up: capture_time_us, seq; down: sent_time_us, turn_index
# A start message with a long system prompt fits, and so does the longest audio frame the FrameChecker hears (1 s at
# 48 kHz, 96 KB: a longer one gets the checker's reason, not the socket's bare 1009).
MAX_MESSAGE_BYTES = 128 * 1024
CLOSE_REASON_BYTES = 123  # the WebSocket limit; the full message goes in the error event before the close

CLOSE_OK = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_BAD_REQUEST = 4400
CLOSE_UNAUTHENTICATED = 4401
CLOSE_ORIGIN = 4403
CLOSE_IDLE = 4408
CLOSE_TAKEN_OVER = 4409
CLOSE_FULL = 4429
CLOSE_CODES = {
    grpc.StatusCode.UNAUTHENTICATED: CLOSE_UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: CLOSE_ORIGIN,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CLOSE_FULL,
    grpc.StatusCode.DEADLINE_EXCEEDED: CLOSE_IDLE,
    grpc.StatusCode.UNAVAILABLE: CLOSE_GOING_AWAY,  # a gateway that is shutting down: connect again elsewhere
}


def close_code(error: RequestError) -> int:
    """The close code that tells the page why it was refused."""
    return CLOSE_CODES.get(error.code, CLOSE_BAD_REQUEST)


def close_reason(reason: str) -> bytes:
    """A close reason cut to the WebSocket limit, at a character boundary: a reason that is not UTF-8 fails the
    page's connection (close 1007) instead of telling it why."""
    return reason.encode()[:CLOSE_REASON_BYTES].decode(errors="ignore").encode()


def parse_uplink_frame(data: bytes, rate_hz: int) -> tuple[int, int, bytes]:
    """One binary WebSocket message -> (capture_time_us, seq, PCM16LE); raises RequestError for a message too short
    to hold the header and a sample. The audio's size is the FrameChecker's to judge: any whole number of samples up
    to MAX_FRAME_MS is heard, so a client that frames differently loses nothing."""
    if len(data) < FRAME_HEADER.size + 2:
        raise invalid(
            f"audio message of {len(data)} bytes; send a {FRAME_HEADER.size}-byte header (capture_time_us, seq) "
            f"and then PCM16LE mono at {rate_hz} Hz ({samples_per_frame(rate_hz) * 2} bytes for 20 ms)"
        )
    capture_us, seq = FRAME_HEADER.unpack_from(data)
    return capture_us, seq, data[FRAME_HEADER.size :]


def session_config(raw: object) -> conversation_pb2.SessionConfig:
    """The page's `config` (JSON) as a SessionConfig; raises RequestError naming what is wrong."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise invalid("config must be a JSON object (a SessionConfig)")
    try:
        return json_format.ParseDict(raw, conversation_pb2.SessionConfig())
    except json_format.ParseError as error:
        raise invalid(f"config is not a SessionConfig: {error}") from error


def event_message(event: conversation_pb2.ConverseEvent) -> dict[str, Any]:
    """A Converse event as the page's JSON: its kind, its turn, its fields (every field, defaults included)."""
    kind = event.WhichOneof("event")
    fields = _plain(getattr(event, kind)) if kind else {}
    return {"type": kind or "unknown", "turn_index": event.turn_index, **fields}


def _plain(message: Message) -> dict[str, Any]:
    # Not json_format: it writes int64 as strings, and epoch microseconds fit a JavaScript number exactly.
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            value = [_plain(v) for v in value] if field.is_repeated else _plain(value)
        elif field.is_repeated:
            value = list(value)
        out[field.name] = value
    return out


def error_message(error: RequestError, recoverable: bool = False) -> dict[str, Any]:
    """The error event the page shows (a non-recoverable one comes just before the close)."""
    return {"type": "error", "code": error.code.name, "message": error.message, "recoverable": recoverable}
