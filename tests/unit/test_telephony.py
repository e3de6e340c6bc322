"""The telephony door's parts without a network: webhook signatures, stream tokens, the carriers' messages, chunk
order and gap filling, and the marks' ledger."""

from __future__ import annotations

import base64
import time
from xml.etree import ElementTree

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gateway.telephony.carrier import CarrierError, Connected, Digit, MarkEcho, Media, Start, Stop, Webhook
from gateway.telephony.marks import MarkLedger
from gateway.telephony.signatures import telnyx_public_key, twilio_signature, verify_telnyx, verify_twilio
from gateway.telephony.telnyx import Telnyx
from gateway.telephony.tokens import StreamTokens
from gateway.telephony.twilio import Twilio
from gateway.telephony.uplink import REORDER_CHUNKS, CallerAudio, ChunkOrder
from voicemesh import g711
from voicemesh.errors import RequestError

# Twilio's published example of a signed request (its helper library's test vectors).
TOKEN = "12345"
URL = "https://mycompany.com/myapp.php?foo=1&bar=2"
PARAMS = {
    "CallSid": ["CA1234567890ABCDE"],
    "Caller": ["+14158675309"],
    "Digits": ["1234"],
    "From": ["+14158675309"],
    "To": ["+18005551212"],
}


def test_twilio_signature_matches_twilios_example() -> None:
    assert twilio_signature(TOKEN, URL, PARAMS) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    verify_twilio(TOKEN, URL, PARAMS, "RSOYDt4T1cUTdK1PDd93/VVr8B8=")


@pytest.mark.parametrize(
    ("url", "signature"),
    [
        (URL.replace(".com", ".com:1234"), "RSOYDt4T1cUTdK1PDd93/VVr8B8="),  # signed without the port
        (URL, "kvajT1Ptam85bY51eRf/AJRuM3w="),  # signed with https's 443 written out
        (URL.replace("https", "http"), "0ZXoZLH/DfblKGATFgpif+LLRf4="),  # signed with http's 80 written out
        (URL.replace(".com", ".com:1234").replace("https", "http"), "Zmvh+3yNM1Phv2jhDCwEM3q5ebU="),
    ],
)
def test_twilio_signature_with_and_without_the_port(url: str, signature: str) -> None:
    verify_twilio(TOKEN, url, PARAMS, signature)


@pytest.mark.parametrize(
    ("token", "url", "params", "signature", "words"),
    [
        (TOKEN, URL, PARAMS, "", "no X-Twilio-Signature"),
        ("54321", URL, PARAMS, "RSOYDt4T1cUTdK1PDd93/VVr8B8=", "does not match"),
        (TOKEN, URL + "&x=1", PARAMS, "RSOYDt4T1cUTdK1PDd93/VVr8B8=", "does not match"),
        (TOKEN, URL, {**PARAMS, "Digits": ["9"]}, "RSOYDt4T1cUTdK1PDd93/VVr8B8=", "does not match"),
    ],
)
def test_twilio_signature_refusals(
    token: str, url: str, params: dict[str, list[str]], signature: str, words: str
) -> None:
    with pytest.raises(RequestError, match=words) as refused:
        verify_twilio(token, url, params, signature)
    assert refused.value.code.name == "PERMISSION_DENIED"


def telnyx_keys() -> tuple[Ed25519PrivateKey, str]:
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return private, base64.b64encode(public).decode()


def test_telnyx_signature() -> None:
    private, public = telnyx_keys()
    key = telnyx_public_key(public)
    body = b"CallSid=v3%3Aabc&From=%2B15550001111"
    now = int(time.time())
    signature = base64.b64encode(private.sign(f"{now}|".encode() + body)).decode()
    verify_telnyx(key, str(now), body, signature)
    for timestamp, signed_body, words in (
        (str(now), body + b"&x=1", "does not sign"),
        (str(now - 301), body, "from now"),
        ("soon", body, "not epoch seconds"),
        ("", body, "no telnyx-signature"),
    ):
        with pytest.raises(RequestError, match=words):
            verify_telnyx(key, timestamp, signed_body, signature)
    other = base64.b64encode(Ed25519PrivateKey.generate().sign(f"{now}|".encode() + body)).decode()
    with pytest.raises(RequestError, match="does not sign"):
        verify_telnyx(key, str(now), body, other)
    with pytest.raises(ValueError, match="not a base64 Ed25519 public key"):
        telnyx_public_key("abc")


def test_stream_tokens_are_for_one_call_one_carrier_once_and_expire() -> None:
    tokens = StreamTokens("secret", ttl_s=30)
    token = tokens.issue("twilio", "CA1")
    with pytest.raises(RequestError, match="another call"):
        tokens.redeem(token, "twilio", "CA2")
    with pytest.raises(RequestError, match="not one this gateway issued"):
        tokens.redeem(token, "telnyx", "CA1")
    with pytest.raises(RequestError, match="not one this gateway issued"):
        StreamTokens("other", 30).redeem(token, "twilio", "CA1")
    tokens.redeem(token, "twilio", "CA1")
    with pytest.raises(RequestError, match="used already"):
        tokens.redeem(token, "twilio", "CA1")
    expired = StreamTokens("secret", ttl_s=30, clock=lambda: time.time() - 60).issue("twilio", "CA1")
    with pytest.raises(RequestError, match="expired") as refused:
        tokens.redeem(expired, "twilio", "CA1")
    assert refused.value.code.name == "UNAUTHENTICATED"
    with pytest.raises(RequestError, match="no token"):
        tokens.redeem("", "twilio", "CA1")


def media(chunk: int, data: bytes = b"\xff" * 160, **extra: str) -> dict[str, object]:
    return {
        "event": "media",
        "sequenceNumber": str(chunk + 1),
        "media": {
            "track": "inbound",
            "chunk": str(chunk),
            "timestamp": str(chunk * 20),
            "payload": base64.b64encode(data).decode(),
            **extra,
        },
        "streamSid": "MZ1",
    }


def test_twilio_messages_in_and_out() -> None:
    twilio = Twilio(TOKEN)
    assert twilio.parse({"event": "connected", "protocol": "Call", "version": "1.0.0"}) == Connected()
    start = {
        "event": "start",
        "sequenceNumber": "1",
        "start": {
            "accountSid": "AC1",
            "streamSid": "MZ1",
            "callSid": "CA1",
            "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            "customParameters": {"token": "tok"},
        },
        "streamSid": "MZ1",
    }
    assert twilio.parse(start) == Start("MZ1", "CA1", "PCMU", "tok")
    assert twilio.parse(media(3)) == Media(3, b"\xff" * 160, inbound=True)
    assert twilio.parse(
        {"event": "dtmf", "streamSid": "MZ1", "sequenceNumber": "5", "dtmf": {"track": "inbound_track", "digit": "1"}}
    ) == Digit("1")
    assert twilio.parse(
        {"event": "mark", "sequenceNumber": "4", "streamSid": "MZ1", "mark": {"name": "t0c1"}}
    ) == MarkEcho("t0c1")
    assert (
        twilio.parse(
            {
                "event": "stop",
                "sequenceNumber": "5",
                "streamSid": "MZ1",
                "stop": {"accountSid": "AC1", "callSid": "CA1"},
            }
        )
        == Stop()
    )
    assert twilio.media("MZ1", b"\x01\x02") == {"event": "media", "streamSid": "MZ1", "media": {"payload": "AQI="}}
    assert twilio.mark("MZ1", "t0c1") == {"event": "mark", "streamSid": "MZ1", "mark": {"name": "t0c1"}}
    assert twilio.clear("MZ1") == {"event": "clear", "streamSid": "MZ1"}
    stream = ElementTree.fromstring(twilio.answer("wss://example.com/telephony/twilio/stream", 'a"b<')).find(
        "./Connect/Stream"
    )
    assert stream is not None and stream.get("url") == "wss://example.com/telephony/twilio/stream"
    assert [(p.get("name"), p.get("value")) for p in stream.findall("Parameter")] == [("token", 'a"b<')]


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ({"event": "hangup"}, "event 'hangup' unknown; Twilio sends"),
        ({"event": "dtmf", "dtmf": {"digit": "12"}}, "dtmf.digit='12' is not a phone key"),
        ({**media(1), "media": {"chunk": "1", "payload": "not base64!"}}, "media.payload is not base64"),
        ({**media(1), "media": {"chunk": "1", "payload": ""}}, "media.payload is empty"),
        ({**media(1), "media": {"chunk": "x1", "payload": "AQI="}}, "media.chunk='x1' is not a whole number"),
        ({"event": "media", "streamSid": "MZ1"}, "has no media.chunk"),
        ({"event": "start", "start": {"mediaFormat": {"encoding": "audio/l16", "sampleRate": 8000}}}, "unsupported"),
    ],
)
def test_twilio_bad_messages_are_refused_by_name(message: dict[str, object], words: str) -> None:
    with pytest.raises(RequestError, match=words):
        Twilio(TOKEN).parse(message)


def test_telnyx_messages_in_and_out() -> None:
    telnyx = Telnyx(telnyx_public_key(telnyx_keys()[1]))
    start = {
        "event": "start",
        "sequence_number": "1",
        "stream_id": "32DE",
        "start": {
            "call_control_id": "v3:abc",
            "custom_parameters": {"token": "tok"},
            "media_format": {"encoding": "PCMA", "sample_rate": 8000, "channels": 1},
        },
    }
    assert telnyx.parse(start) == Start("32DE", "v3:abc", "PCMA", "tok")
    assert telnyx.parse({"event": "error", "payload": {"code": 100002, "title": "Unknown error"}}) == CarrierError(
        "{'code': 100002, 'title': 'Unknown error'}"
    )
    assert telnyx.media("32DE", b"\x01\x02") == {"event": "media", "media": {"payload": "AQI="}}
    assert telnyx.clear("32DE") == {"event": "clear"}
    assert 'bidirectionalMode="rtp"' in telnyx.answer("wss://x/telephony/telnyx/stream", "tok")


def test_chunks_in_order_pass_at_once() -> None:
    order = ChunkOrder(b"\xff" * 8000)
    assert [order.push(n, bytes([n])) for n in (1, 2, 3)] == [[b"\x01"], [b"\x02"], [b"\x03"]]


def test_a_late_chunk_is_put_back_in_its_place() -> None:
    order = ChunkOrder(b"\xff" * 8000)
    assert order.push(1, b"a") == [b"a"]
    assert order.push(3, b"c") == []
    assert order.push(2, b"b") == [b"b", b"c"]
    assert order.filled == 0


def test_a_lost_chunk_becomes_silence_of_its_neighbours_length_and_is_counted() -> None:
    order = ChunkOrder(b"\xff" * 8000)
    order.push(1, b"a" * 160)
    ready = [chunk for n in range(3, 3 + REORDER_CHUNKS) for chunk in order.push(n, b"x" * 160)]
    assert ready == [b"\xff" * 160] + [b"x" * 160] * REORDER_CHUNKS
    assert order.filled == 1
    assert order.push(2, b"b" * 160) == []  # too late: its place was filled
    assert order.late == 1
    with pytest.raises(RequestError, match="over 50 chunks missing"):
        order.push(1000, b"z")


def test_caller_audio_decodes_alaw_and_ulaw() -> None:
    pcm = bytes(range(0, 256, 2)) * 2
    assert CallerAudio("PCMU").push(1, g711.ulaw_encode(pcm)) == [g711.ulaw_decode(g711.ulaw_encode(pcm))]
    assert CallerAudio("PCMA").push(7, g711.alaw_encode(pcm)) == [g711.alaw_decode(g711.alaw_encode(pcm))]


def test_mark_ledger() -> None:
    ledger = MarkLedger()
    first = ledger.add(0, "Hello.", due_s=10.0)
    second = ledger.add(0, "How are you?", due_s=11.0)
    third = ledger.add(1, "Sure.", due_s=20.0)
    assert ledger.echoed(first) is not None and ledger.echoed(first) is None
    assert ledger.unknown == 1
    assert [mark.name for mark in ledger.overdue(15.0)] == [second]
    assert ledger.clear_turn(1) == 1 and ledger.echoed(third) is None and len(ledger) == 0


def test_webhook_is_a_plain_record() -> None:
    request = Webhook(
        "https://x/telephony/twilio/voice", {"X-Twilio-Signature": "s"}, b"CallSid=CA1", {"CallSid": ["CA1"]}
    )
    assert Twilio(TOKEN).call_id(request) == "CA1"
