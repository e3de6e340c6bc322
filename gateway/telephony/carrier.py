"""What every carrier's media stream says, in the door's own words: one adapter per carrier (twilio.py, telnyx.py)
turns its JSON into these events and writes its messages, so no carrier's field names leave its adapter."""

from __future__ import annotations

import base64
import binascii
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import quoteattr

from gateway.telephony.signatures import forbidden
from voicemesh import g711
from voicemesh.errors import invalid


@dataclass(frozen=True)
class Connected:
    """The carrier's greeting, before the start."""


@dataclass(frozen=True)
class Start:
    stream_id: str
    call_id: str
    encoding: str
    """"PCMU" (μ-law) or "PCMA" (A-law), 8 kHz mono."""
    token: str
    """The stream token the webhook answer handed the carrier ("" if none came)."""


@dataclass(frozen=True)
class Media:
    chunk: int
    """The carrier's count of its media messages, from 1: the order the audio was captured in."""
    payload: bytes
    """G.711 bytes, one a sample."""
    inbound: bool
    """The caller's side (the other track, where a carrier sends it, is the reply coming back)."""


@dataclass(frozen=True)
class Digit:
    digit: str
    duration_ms: int = 0


@dataclass(frozen=True)
class MarkEcho:
    """A mark the door sent came back: the audio before it has played (or was cleared)."""

    name: str


@dataclass(frozen=True)
class Stop:
    """The call, or its stream, ended."""


@dataclass(frozen=True)
class CarrierError:
    """The carrier reports a problem with the stream; the call goes on."""

    detail: str


CarrierEvent = Connected | Start | Media | Digit | MarkEcho | Stop | CarrierError

DTMF_KEYS = "0123456789*#ABCD"
CODECS = {"PCMU": (g711.ulaw_decode, g711.ulaw_encode), "PCMA": (g711.alaw_decode, g711.alaw_encode)}


@dataclass(frozen=True)
class Webhook:
    """The HTTP request a carrier sends when a call comes in, as the door hands it to the adapter."""

    url: str
    """The URL the carrier requested, as it was configured there (the public one)."""
    headers: Mapping[str, str]
    body: bytes
    form: Mapping[str, Sequence[str]]


class MediaStream(ABC):
    """What the carriers' stream protocols share (media, mark, dtmf, stop, connected); an adapter adds its `start`,
    any events of its own, and its outbound messages."""

    name = ""
    events = "connected, start, media, dtmf, mark and stop"
    stream_attributes = ""
    """The carrier's own attributes of <Stream> in the webhook's answer."""

    def parse(self, message: dict[str, Any]) -> CarrierEvent:
        """One stream message; raises INVALID_ARGUMENT naming what is wrong."""
        event = message.get("event")
        if event == "media":
            media = message.get("media")
            inbound = (media.get("track", "inbound") if isinstance(media, dict) else "") == "inbound"
            return Media(number_field(message, "media", "chunk"), payload(message, "media", "payload"), inbound)
        if event == "mark":
            return MarkEcho(text_field(message, "mark", "name"))
        if event == "dtmf":
            digit = text_field(message, "dtmf", "digit")
            if len(digit) != 1 or digit not in DTMF_KEYS:
                raise invalid(f"dtmf.digit={digit[:8]!r} is not a phone key; send one of {DTMF_KEYS}")
            return Digit(digit)
        if event == "start":
            return self.start(message)
        if event == "stop":
            return Stop()
        if event == "connected":
            return Connected()
        return self.other(str(event), message)

    @abstractmethod
    def start(self, message: dict[str, Any]) -> Start:
        """The stream's start message, read by the carrier's names."""

    @abstractmethod
    def verify(self, request: Webhook) -> None:
        """Raises PERMISSION_DENIED unless the carrier signed this webhook."""

    def call_id(self, request: Webhook) -> str:
        """The call a verified webhook announces (its stream token is bound to it): both carriers' voice webhooks
        (TwiML, and TeXML after it) name it CallSid."""
        call_sid = request.form.get("CallSid", [""])[0]
        if not call_sid:
            raise forbidden("the voice webhook names no CallSid")
        return call_sid

    def answer(self, stream_url: str, token: str) -> str:
        """The webhook's answer: connect the call's audio to `stream_url` both ways, handing the carrier `token` as a
        custom parameter of the stream."""
        attributes = f" {self.stream_attributes}" if self.stream_attributes else ""
        return (
            '<?xml version="1.0" encoding="UTF-8"?><Response><Connect>'
            f"<Stream url={quoteattr(stream_url)}{attributes}>"
            f'<Parameter name="token" value={quoteattr(token)}/></Stream></Connect></Response>'
        )

    @abstractmethod
    def media(self, stream_id: str, audio: bytes) -> dict[str, Any]:
        """A media message carrying `audio` (G.711 at 8 kHz) to the caller."""

    @abstractmethod
    def mark(self, stream_id: str, name: str) -> dict[str, Any]:
        """A mark message: the carrier echoes it once the audio before it has played."""

    @abstractmethod
    def clear(self, stream_id: str) -> dict[str, Any]:
        """A clear message: the carrier drops the audio it still holds."""

    def other(self, event: str, message: dict[str, Any]) -> CarrierEvent:
        raise invalid(f"event {event[:32]!r} unknown; {self.name} sends {self.events}")


def custom_parameter(start: Any, name: str) -> str:
    """A custom parameter of the stream (from the webhook's answer), "" if absent."""
    value = start.get(name, "") if isinstance(start, dict) else ""
    return value if isinstance(value, str) else ""


def field(message: Mapping[str, Any], *path: str) -> Any:
    """message[path[0]][path[1]]...; INVALID_ARGUMENT naming the path if it is missing."""
    value: Any = message
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            raise invalid(f"{message.get('event')!r} message has no {'.'.join(path)}")
        value = value[key]
    return value


def text_field(message: Mapping[str, Any], *path: str) -> str:
    value = field(message, *path)
    if not isinstance(value, str):
        raise invalid(f"{'.'.join(path)} of a {message.get('event')!r} message must be a string")
    return value


def number_field(message: Mapping[str, Any], *path: str) -> int:
    """A count the carriers send as a string of digits."""
    value = field(message, *path)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise invalid(f"{'.'.join(path)}={str(value)[:32]!r} is not a whole number") from None


def payload(message: Mapping[str, Any], *path: str) -> bytes:
    """The base64 audio of a media message; INVALID_ARGUMENT if it is not base64 or empty."""
    encoded = text_field(message, *path)
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as error:
        raise invalid(f"{'.'.join(path)} is not base64 ({error})") from None
    if not data:
        raise invalid(f"{'.'.join(path)} is empty; send the call's audio")
    return data


def encode_payload(data: bytes) -> str:
    return base64.b64encode(data).decode()
