"""Twilio Media Streams: the voice webhook answers TwiML <Connect><Stream> (bidirectional), and the stream speaks
connected/start/media/dtmf/mark/stop in and media/mark/clear out, μ-law at 8 kHz."""

from __future__ import annotations

from typing import Any

from gateway.telephony.carrier import (
    MediaStream,
    Start,
    Webhook,
    custom_parameter,
    encode_payload,
    number_field,
    text_field,
)
from gateway.telephony.signatures import verify_twilio
from voicemesh.errors import invalid

ENCODINGS = {"audio/x-mulaw": "PCMU"}


class Twilio(MediaStream):
    """Twilio's names for the door's events and messages; webhooks verified with the account's auth token."""

    name = "Twilio"

    # <Stream url> takes no query string: the token goes as a custom parameter, which arrives in `start`.
    stream_attributes = ""

    def __init__(self, auth_token: str) -> None:
        self._auth_token = auth_token

    def verify(self, request: Webhook) -> None:
        verify_twilio(self._auth_token, request.url, request.form, request.headers.get("X-Twilio-Signature", ""))

    def start(self, message: dict[str, Any]) -> Start:
        encoding = text_field(message, "start", "mediaFormat", "encoding")
        if encoding not in ENCODINGS or number_field(message, "start", "mediaFormat", "sampleRate") != 8000:
            raise invalid(f"mediaFormat encoding={encoding!r} unsupported; stream audio/x-mulaw at 8000 Hz")
        return Start(
            text_field(message, "start", "streamSid"),
            text_field(message, "start", "callSid"),
            ENCODINGS[encoding],
            custom_parameter(message["start"].get("customParameters"), "token"),
        )

    def media(self, stream_id: str, audio: bytes) -> dict[str, Any]:
        return {"event": "media", "streamSid": stream_id, "media": {"payload": encode_payload(audio)}}

    def mark(self, stream_id: str, name: str) -> dict[str, Any]:
        return {"event": "mark", "streamSid": stream_id, "mark": {"name": name}}

    def clear(self, stream_id: str) -> dict[str, Any]:
        return {"event": "clear", "streamSid": stream_id}
