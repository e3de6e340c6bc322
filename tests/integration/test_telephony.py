"""Phone calls through the telephony door: a test carrier speaking Twilio's and Telnyx's protocols (voicemesh/phone.py)
places real calls on a gateway over real ASR, LLM and TTS services."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import numpy as np
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gateway.server import GatewayServer
from harness.clips import clip_path, load_clip
from tests.integration.helpers import start_gateway, start_offline_gateway
from voicemesh.audio import Clip
from voicemesh.clients import epoch_us
from voicemesh.loadtest import LoadTestOptions, loadtest
from voicemesh.phone import CallRefused, Carrier, PhoneCall

pytestmark = pytest.mark.integration

AUTH_TOKEN = "twilio-test-auth-token"
TELNYX_KEY = Ed25519PrivateKey.generate()
TELNYX_PUBLIC = base64.b64encode(TELNYX_KEY.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()
TWILIO = Carrier("twilio", auth_token=AUTH_TOKEN)
TELNYX = Carrier("telnyx", signing_key=TELNYX_KEY)
# A persona that answers at length, so a reply is still playing when the caller speaks over it.
TALKATIVE = json.dumps(
    {
        "system_prompt": "A talkative assistant who always answers with three long sentences.",
        "options": {"max_tokens": 120},
    }
)
DOORS = {"twilio_auth_token": AUTH_TOKEN, "telnyx_public_key": TELNYX_PUBLIC, "telephony_config": TALKATIVE}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway(services: dict[str, str]):
    server = await start_gateway(services["asr"], services["llm"], services["tts"], **DOORS)
    yield server
    await server.stop()


def target(server: GatewayServer) -> str:
    return f"127.0.0.1:{server.http_port}"


def quiet(seconds: float) -> Clip:
    return Clip(np.zeros(int(seconds * 8000), np.float32), 8000)


async def until_ended(server: GatewayServer, session_id: str | None = None, timeout_s: float = 5.0) -> None:
    """The session (without an id: every session) is gone from the gateway: its slot is free."""
    assert server.registry is not None
    active = server.registry.active
    deadline = time.monotonic() + timeout_s
    while (session_id in active) if session_id else active:
        assert time.monotonic() < deadline, f"{session_id or list(active)} still open {timeout_s:g} s after the call"
        await asyncio.sleep(0.05)


def replied(call: PhoneCall, after_us: int, quiet_s: float = 1.5) -> bool:
    """Reply audio came after `after_us`, all its marks came back, and nothing has arrived for `quiet_s`."""
    media = call.media_after(after_us)
    if not media:
        return False
    marks = [heard.name for heard in call.received if heard.kind == "mark"]
    return (time.time() * 1e6 - call.received[-1].at_us) / 1e6 > quiet_s and bool(marks)


async def test_a_spoken_turn_on_twilio_is_answered_and_the_history_keeps_what_was_heard(gateway) -> None:
    async with PhoneCall(target(gateway), TWILIO) as call:
        await call.dial()
        await call.speak(load_clip("spk1_snt1"), then_silence_s=20.0, until=lambda: replied(call, 0))
        media = call.media_after(0)
        assert sum(len(m.pcm16) for m in media) / 2 / 8000 > 0.5, "more than half a second of reply audio came back"
        marks = [heard.name for heard in call.received if heard.kind == "mark"]
        assert marks and all(name.startswith("t0") for name in marks)
        history = gateway.registry.history(call.session_id)
        assert [entry.role for entry in history] == ["user", "assistant"], history
        assert "child" in history[0].text.lower() and history[1].text.strip() and not history[1].interrupted
        await call.dtmf("5")
        await call.hang_up()
    await until_ended(gateway, call.session_id)
    assert not [h for h in call.received if h.kind == "clear"], "nothing was cleared: nobody spoke over the reply"


async def test_the_history_keeps_no_words_whose_marks_never_came_back(gateway) -> None:
    """A carrier that echoes no mark: the reply is sent, but nothing of it counts as heard."""
    async with PhoneCall(target(gateway), TWILIO, echo_marks=False) as call:
        await call.dial()
        await call.speak(load_clip("spk1_snt1"), then_silence_s=20.0, until=lambda: replied(call, 0, quiet_s=4.0))
        assert call.media_after(0), "the reply was sent"
        history = gateway.registry.history(call.session_id)
        assert [entry.role for entry in history] == ["user"], f"an unheard reply is not in the history: {history}"
        await call.hang_up()
    await until_ended(gateway, call.session_id)


async def test_barge_in_clears_the_carrier_and_no_stale_media_follows(gateway) -> None:
    wizard = load_clip("wizard")
    async with PhoneCall(target(gateway), TWILIO) as call:
        await call.dial()
        question = await speech_question()
        # The caller speaks once the first words of the reply were heard (their mark came back) and it goes on.
        await call.speak(question, then_silence_s=15.0, until=lambda: heard_some(call))
        assert call.echoed, "some of the reply was heard"
        await call.speak(wizard)
        wizard_end_us = epoch_us()
        await call.speak(quiet(0.02), then_silence_s=20.0, until=lambda: replied(call, wizard_end_us))
        clears = [heard.at_us for heard in call.received if heard.kind == "clear"]
        assert clears, "speech over the reply cleared the carrier's queue"
        after = [heard for heard in call.received if heard.at_us > clears[0]]
        stale = [heard.name for heard in after if heard.kind == "mark" and heard.name.startswith("t0")]
        assert not stale, f"marks of the interrupted reply after the clear: {stale}"
        # The caller is still talking a second after the clear, so no reply can have started: media then is stale.
        soon = [heard for heard in after if heard.kind == "media" and heard.at_us < clears[0] + 1_000_000]
        assert not soon, f"{len(soon)} media frames within 1 s of the clear"
        history = gateway.registry.history(call.session_id)
        lines = [(entry.role, entry.text, entry.interrupted) for entry in history]
        assert history[1].role == "assistant" and history[1].interrupted and history[1].text, lines
        assert "dragon" in history[0].text.lower() and "wizard" in history[2].text.lower(), lines
        await call.hang_up()
    await until_ended(gateway, call.session_id)


def heard_some(call: PhoneCall) -> bool:
    """A mark came back, and the reply went on for 0.3 s after it."""
    return bool(call.echoed) and any(heard.at_us > call.echoed[0].at_us + 300_000 for heard in call.media_after(0))


async def speech_question() -> Clip:
    from harness.clips import spoken

    return spoken("Can you tell me a long story about a dragon?")


async def test_dtmf_reaches_the_session(gateway, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gateway.session")
    async with PhoneCall(target(gateway), TWILIO) as call:
        await call.dial()
        await call.speak(quiet(0.3))
        await call.dtmf("7")
        await call.speak(quiet(0.3))
        await call.hang_up()
    await until_ended(gateway, call.session_id)
    digits = [r.digit for r in caplog.records if r.getMessage() == "dtmf" and r.session_id == call.session_id]
    assert digits == ["7"]


async def test_a_dropped_socket_ends_the_session_and_other_calls_go_on(gateway) -> None:
    async with PhoneCall(target(gateway), TELNYX) as dropped, PhoneCall(target(gateway), TELNYX) as kept:
        await dropped.dial()
        await kept.dial()
        await asyncio.gather(dropped.speak(quiet(0.5)), kept.speak(quiet(0.5)))
        await dropped.drop()
        await until_ended(gateway, dropped.session_id)
        await kept.speak(load_clip("spk2_snt1"), then_silence_s=20.0, until=lambda: replied(kept, 0))
        assert kept.media_after(0), "the other call was answered"
        await kept.hang_up()
    await until_ended(gateway, kept.session_id)


async def test_telnyx_out_of_order_and_lost_chunks_are_heard_in_order(gateway) -> None:
    """Chunks 2 and 3 swapped and chunk 10 lost: the caller is still understood and answered."""
    clip = load_clip("spk1_snt1").to_rate(8000)
    frames = clip.frames()
    async with PhoneCall(target(gateway), Carrier("telnyx", signing_key=TELNYX_KEY, encoding="PCMA")) as call:
        await call.dial()
        order = [1, 3, 2, *range(4, 10), *range(11, len(frames) + 1)]
        for number in order:
            await call.send(frames[number - 1], chunk=number)
            await asyncio.sleep(0.02)
        await call.speak(quiet(0.1), then_silence_s=20.0, until=lambda: replied(call, 0))
        history = gateway.registry.history(call.session_id)
        assert history and "child" in history[0].text.lower(), history
        await call.hang_up()
    await until_ended(gateway, call.session_id)


# ---- refusals: no backends needed ------------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def offline():
    server = await start_offline_gateway(**DOORS, max_audio_ahead_ms=1000.0)
    yield server
    await server.stop()


async def test_a_webhook_that_fails_verification_gets_403_and_opens_nothing(offline) -> None:
    async with PhoneCall(target(offline), Carrier("twilio", auth_token="not-the-token")) as call:
        with pytest.raises(CallRefused) as refused:
            await call.webhook()
        assert refused.value.status == 403
    async with PhoneCall(target(offline), TELNYX) as call:
        with pytest.raises(CallRefused) as refused:
            await call.webhook(tamper=True)
        assert refused.value.status == 403
    await until_ended(offline)


async def refused_stream(server: GatewayServer, *messages: object, token: str | None = None) -> int | None:
    """Open a stream after a good webhook, send `messages` ("START": the start, with `token` if given), return the
    close code."""
    async with PhoneCall(target(server), TWILIO) as call:
        url, issued = await call.webhook()
        await call.open_stream(url, issued, start=False)
        for message in messages:
            start = message == "START"
            await call.send_message(call.start_message(token or issued) if start else message)  # type: ignore[arg-type]
        await asyncio.wait_for(call.closed.wait(), 15)
        return call.close_code


@pytest.mark.parametrize(
    ("messages", "token", "code"),
    [
        ([{"event": "media", "media": {"chunk": "1", "payload": "//8="}}], None, 4400),  # media before start
        (["START"], "forged", 4401),  # unknown token
        (["START", {"event": "hangup"}], None, 4400),  # unknown event
        (["START", {"event": "media", "media": {"chunk": "1", "payload": "%%%"}}], None, 4400),  # bad base64
        (["START", "not json"], None, 4400),
    ],
)
async def test_bad_streams_are_refused_with_a_reason(offline, caplog, messages, token, code) -> None:
    caplog.set_level(logging.INFO)
    assert await refused_stream(offline, *messages, token=token) == code
    reasons = [r for r in caplog.records if "refused" in r.getMessage()]
    assert reasons and all(getattr(r, "reason", "") for r in reasons)
    await until_ended(offline)


async def test_an_expired_or_reused_token_is_refused(offline) -> None:
    async with PhoneCall(target(offline), TWILIO) as call:
        url, token = await call.webhook()
        await call.open_stream(url, token)
        await call.speak(quiet(0.2))
        async with PhoneCall(target(offline), TWILIO, call_id=call.call_id) as replay:
            await replay.open_stream(url, token)
            await asyncio.wait_for(replay.closed.wait(), 15)
            assert replay.close_code == 4401
        assert not call.closed.is_set(), "the real call goes on"
        await call.hang_up()


async def test_a_flood_faster_than_real_time_is_refused(offline) -> None:
    async with PhoneCall(target(offline), TWILIO) as call:
        await call.dial()
        for _ in range(150):  # 3 s of audio at once, past max_audio_ahead_ms
            await call.send(bytes(320))
        await asyncio.wait_for(call.closed.wait(), 15)
        assert call.close_code == 4429
    await until_ended(offline, call.session_id)


async def test_the_load_test_places_phone_calls(gateway) -> None:
    options = LoadTestOptions(
        target=target(gateway),
        transport="twilio",
        sessions=1,
        turns=2,
        audio=(str(clip_path("spk1_snt1")), str(clip_path("horizon"))),
        pause_s=(0.5, 0.5),
        twilio_auth_token=AUTH_TOKEN,
    )
    report = await loadtest(options)
    assert report.turns.ok == 2, [(row.status, row.detail) for row in report.per_turn]
    assert all(row.v2v_ms is not None and row.v2v_ms > 0 for row in report.per_turn)
    assert "twilio_auth_token" not in report.to_json()["config"]  # type: ignore[operator]
