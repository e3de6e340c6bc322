"""Telnyx media streaming, bidirectional in RTP mode: the TeXML webhook answers <Connect><Stream> with
bidirectionalMode="rtp", and the stream speaks connected/start/media/dtmf/mark/error/stop in and media/mark/clear
out, PCMU or PCMA at 8 kHz. Its frames may arrive out of order; each media frame's chunk number orders them."""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gateway.telephony.carrier import (
    CODECS,
    CarrierError,
    CarrierEvent,
    MediaStream,
    Start,
    Webhook,
    custom_parameter,
    encode_payload,
    number_field,
    text_field,
)
from gateway.telephony.signatures import verify_telnyx
from voicemesh.errors import invalid


class Telnyx(MediaStream):
    """Telnyx's names for the door's events and messages; webhooks verified with the account's Ed25519 key."""

    name = "Telnyx"
    events = "connected, start, media, dtmf, mark, error and stop"

    def __init__(self, public_key: Ed25519PublicKey, codec: str = "PCMU") -> None:
        self._key = public_key
        self.codec = codec
        self.stream_attributes = (
            f'track="inbound_track" codec="{codec}" bidirectionalMode="rtp" bidirectionalCodec="{codec}"'
        )

    def verify(self, request: Webhook) -> None:
        verify_telnyx(
            self._key,
            request.headers.get("telnyx-timestamp", ""),
            request.body,
            request.headers.get("telnyx-signature-ed25519", ""),
        )

    def start(self, message: dict[str, Any]) -> Start:
        encoding = text_field(message, "start", "media_format", "encoding")
        if encoding not in CODECS or number_field(message, "start", "media_format", "sample_rate") != 8000:
            raise invalid(f"media_format encoding={encoding!r} unsupported; stream PCMU or PCMA at 8000 Hz")
        return Start(
            text_field(message, "stream_id"),
            text_field(message, "start", "call_control_id"),
            encoding,
            custom_parameter(message["start"].get("custom_parameters"), "token"),
        )

    def other(self, event: str, message: dict[str, Any]) -> CarrierEvent:
        if event == "error":
            return CarrierError(str(message.get("payload", ""))[:200])
        return super().other(event, message)

    def media(self, stream_id: str, audio: bytes) -> dict[str, Any]:
        return {"event": "media", "media": {"payload": encode_payload(audio)}}

    def mark(self, stream_id: str, name: str) -> dict[str, Any]:
        return {"event": "mark", "mark": {"name": name}}

    def clear(self, stream_id: str) -> dict[str, Any]:
        return {"event": "clear"}
