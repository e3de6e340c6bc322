"""/v1/realtime with the official `openai` SDK as the client, against real ASR, LLM and TTS processes: every server
event is checked against the SDK's own types (RealtimeServerEvent), and bad input gets an `error` event while the
connection goes on."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from harness.clips import spoken
from tests.conftest import load_clip
from tests.integration.helpers import start_gateway
from voicemesh import g711
from voicemesh.audio import Clip, float_to_pcm16, pcm16_to_float
from voicemesh.evaluation import words_of

pytestmark = pytest.mark.integration

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
SILENCE_S = 3.0
CHUNK_MS = 40


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway(services: dict[str, str]):
    server = await start_gateway(services["asr"], services["llm"], services["tts"])
    yield server
    await server.stop()


def ws_base(server: Any) -> str:
    return f"ws://127.0.0.1:{server.http_port}/v1"


class Events:
    """The server's events as they come, each validated against the SDK's type of it."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.seen: list[dict[str, Any]] = []
        self._new = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            raw = json.loads(await self.connection.recv_bytes())
            SERVER_EVENT.validate_python(raw)  # the shape the SDK's types say, or the test fails here
            self.seen.append(raw)
            self._new.set()

    async def wait_for(self, kind: str, timeout_s: float = 60.0, after: int = 0, **fields: Any) -> dict[str, Any]:
        """The first event of `kind` (with `fields`) at or past index `after`."""
        try:
            return await asyncio.wait_for(self._first(kind, after, fields), timeout_s)
        except TimeoutError:
            raise AssertionError(f"no {kind} {fields or ''} within {timeout_s:g} s; events: {self.seen[-3:]}") from None

    async def _first(self, kind: str, after: int, fields: dict[str, Any]) -> dict[str, Any]:
        while True:
            for event in self.seen[after:]:
                if event["type"] == kind and all(event.get(k) == v for k, v in fields.items()):
                    return event
            if self._reader.done():
                self._reader.result()
                raise AssertionError(f"the connection ended before {kind}: {self.kinds()}")
            self._new.clear()
            await self._new.wait()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.seen if event["type"] == kind]

    def kinds(self) -> list[str]:
        return [event["type"] for event in self.seen]

    def close(self) -> None:
        self._reader.cancel()


@asynccontextmanager
async def realtime(server: Any, **session: Any) -> AsyncIterator[tuple[Any, Events]]:
    """A connection through the SDK, with `session` sent in a session.update first (if any)."""
    client = AsyncOpenAI(api_key="unused-when-auth-is-off", websocket_base_url=ws_base(server))
    async with client.realtime.connect(model="voicemesh") as connection:
        events = Events(connection)
        try:
            await events.wait_for("session.created")
            if session:
                await connection.session.update(session={"type": "realtime", **session})
                await events.wait_for("session.updated")
            yield connection, events
        finally:
            events.close()


def pcm24k(clip: Clip, silence_s: float = SILENCE_S) -> bytes:
    return float_to_pcm16(np.concatenate([clip.to_rate(24000).samples, np.zeros(int(silence_s * 24000), np.float32)]))


async def stream(connection: Any, data: bytes, rate_hz: int = 24000, sample_bytes: int = 2) -> None:
    """`data` appended in 40 ms pieces at real time (the door refuses audio far ahead of the clock)."""
    step = rate_hz * CHUNK_MS // 1000 * sample_bytes
    loop = asyncio.get_running_loop()
    start = loop.time()
    for index, offset in enumerate(range(0, len(data), step)):
        await connection.input_audio_buffer.append(audio=base64.b64encode(data[offset : offset + step]).decode())
        await asyncio.sleep(max(0.0, start + (index + 1) * CHUNK_MS / 1000 - loop.time()))


def audio_of(events: Events, response_id: str) -> bytes:
    deltas = [e["delta"] for e in events.of("response.output_audio.delta") if e["response_id"] == response_id]
    return b"".join(base64.b64decode(delta) for delta in deltas)


def assert_speech(pcm16: bytes, rate_hz: int) -> None:
    samples = pcm16_to_float(pcm16)
    assert len(samples) > rate_hz // 2, f"only {len(samples) / rate_hz:.2f} s of reply audio"
    assert float(np.sqrt(np.mean(samples**2))) > 0.01, "the reply audio is silent"


def assert_reply(events: Events, done: dict[str, Any]) -> dict[str, Any]:
    response = done["response"]
    assert response["status"] == "completed", response
    assert response["usage"]["output_tokens"] > 0 and response["usage"]["input_tokens"] > 0
    done_transcripts = [
        e for e in events.of("response.output_audio_transcript.done") if e["response_id"] == response["id"]
    ]
    assert done_transcripts and done_transcripts[0]["transcript"].strip()
    kinds = [
        e["type"]
        for e in events.seen
        if e.get("response_id") == response["id"] or e.get("response", {}).get("id") == response["id"]
    ]
    assert kinds[0] == "response.created" and kinds[-1] == "response.done", kinds
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "response.output_audio.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kind in kinds, f"{kind} missing: {kinds}"
    return response


@pytest.mark.parametrize(
    "detection", [{"type": "server_vad", "silence_duration_ms": 500}, {"type": "semantic_vad", "eagerness": "high"}]
)
async def test_a_spoken_turn_gets_transcripts_audio_and_a_completed_response(gateway, detection) -> None:
    async with realtime(gateway, audio={"input": {"turn_detection": detection}}) as (connection, events):
        await stream(connection, pcm24k(load_clip("spk1_snt1")))
        done = await events.wait_for("response.done")
        started = events.of("input_audio_buffer.speech_started")[0]
        stopped = events.of("input_audio_buffer.speech_stopped")[0]
        assert stopped["audio_end_ms"] > started["audio_start_ms"] >= 0 and started["item_id"] == stopped["item_id"]
        committed = await events.wait_for("input_audio_buffer.committed")
        completed = await events.wait_for("conversation.item.input_audio_transcription.completed")
        assert committed["item_id"] == completed["item_id"] == started["item_id"]
        assert "child" in completed["transcript"].lower()
        response = assert_reply(events, done)
        assert_speech(audio_of(events, response["id"]), 24000)


async def test_a_manual_turn_commits_and_asks_for_its_response(gateway) -> None:
    async with realtime(gateway, audio={"input": {"turn_detection": None}}) as (connection, events):
        await stream(connection, pcm24k(load_clip("spk1_snt1"), silence_s=0.3))
        await connection.input_audio_buffer.commit()
        committed = await events.wait_for("input_audio_buffer.committed")
        completed = await events.wait_for("conversation.item.input_audio_transcription.completed")
        assert completed["item_id"] == committed["item_id"] and "child" in completed["transcript"].lower()
        assert not events.of("response.created"), "no response before response.create"
        assert not events.of("input_audio_buffer.speech_started"), "no VAD events with turn detection off"
        await connection.response.create()
        response = assert_reply(events, await events.wait_for("response.done"))
        assert_speech(audio_of(events, response["id"]), 24000)


async def test_a_text_message_gets_audio_and_a_transcript(gateway) -> None:
    async with realtime(gateway, instructions="You answer in one short sentence.") as (connection, events):
        await connection.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "What color is the sky?"}],
            }
        )
        added = await events.wait_for("conversation.item.added")
        assert added["item"]["content"][0]["text"] == "What color is the sky?"
        await connection.response.create()
        response = assert_reply(events, await events.wait_for("response.done"))
        assert_speech(audio_of(events, response["id"]), 24000)


async def test_response_cancel_stops_the_audio_at_once(gateway) -> None:
    session = {
        "instructions": "A talkative assistant who always answers with three long sentences.",
        "max_output_tokens": 120,
    }
    async with realtime(gateway, **session) as (connection, events):
        await connection.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Tell me about the sea."}],
            }
        )
        await connection.response.create()
        first = await events.wait_for("response.output_audio.delta")
        await connection.response.cancel()
        # Events are handled in order: whatever the server sends after this answer, it sent after the cancel.
        await connection.conversation.item.retrieve(item_id=first["item_id"])
        marker = events.seen.index(await events.wait_for("conversation.item.retrieved"))
        done = await events.wait_for("response.done")
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"]["reason"] == "client_cancelled"
        late = [e for e in events.seen[marker:] if e["type"] == "response.output_audio.delta"]
        assert not late, f"{len(late)} audio deltas after the cancel"


async def test_barge_in_cancels_the_response_and_no_audio_of_it_follows(gateway) -> None:
    session = {
        "instructions": "A talkative assistant who always answers with three long sentences.",
        "max_output_tokens": 120,
    }
    async with realtime(gateway, **session) as (connection, events):
        await stream(connection, pcm24k(spoken("Can you tell me a long story about the sea?"), silence_s=0.5))
        silence = asyncio.ensure_future(stream(connection, bytes(24000 * 2 * 15)))
        first = await events.wait_for("response.output_audio.delta")
        silence.cancel()
        await asyncio.sleep(0.5)
        await stream(connection, pcm24k(load_clip("wizard"), silence_s=4.0))
        done = await response_done(events, first["response_id"])
        assert done["response"]["status"] == "cancelled", done
        assert done["response"]["status_details"]["reason"] == "turn_detected"
        cut = events.seen.index(done)
        late = [
            e for e in events.seen[cut:] if e.get("response_id") == first["response_id"] and e["type"].endswith("delta")
        ]
        assert not late, late


async def response_done(events: Events, response_id: str) -> dict[str, Any]:
    after = 0
    while True:
        done = await events.wait_for("response.done", after=after)
        if done["response"]["id"] == response_id:
            return done
        after = events.seen.index(done) + 1


async def test_truncate_keeps_what_was_heard_in_the_history(gateway) -> None:
    async with realtime(gateway, instructions="You answer in two sentences.") as (connection, events):
        await connection.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about cats."}]}
        )
        await connection.response.create()
        done = await events.wait_for("response.done")
        item = done["response"]["output"][0]
        audio_ms = len(audio_of(events, done["response"]["id"])) // 2 * 1000 // 24000
        session_id = events.of("session.created")[0]["session"]["id"]
        await connection.conversation.item.truncate(item_id=item["id"], content_index=0, audio_end_ms=audio_ms // 2)
        truncated = await events.wait_for("conversation.item.truncated")
        assert truncated["item_id"] == item["id"] and truncated["audio_end_ms"] == audio_ms // 2
        history = gateway.servicer.history(session_id)
        said = item["content"][0]["transcript"]
        assistant = [entry for entry in history if entry.role == "assistant"]
        if assistant:  # half of a reply of one chunk is no chunk heard whole: the line leaves the history
            kept = words_of(assistant[-1].text)
            assert assistant[-1].interrupted and kept == words_of(said)[: len(kept)] and kept != words_of(said)
        await connection.conversation.item.retrieve(item_id=item["id"])
        retrieved = await events.wait_for("conversation.item.retrieved")
        assert retrieved["item"]["status"] == "incomplete"
        await connection.conversation.item.truncate(item_id="item_nope", content_index=0, audio_end_ms=10)
        await connection.conversation.item.truncate(item_id=item["id"], content_index=0, audio_end_ms=audio_ms + 5000)
        await events.wait_for("error", after=events.seen.index(retrieved))
        errors = events.of("error")
        assert [e["error"]["param"] for e in errors[-2:]] == ["item_id", "audio_end_ms"], errors


@pytest.mark.parametrize("codec", ["audio/pcmu", "audio/pcma"])
async def test_g711_in_and_out(gateway, codec) -> None:
    encode, decode = {
        "audio/pcmu": (g711.ulaw_encode, g711.ulaw_decode),
        "audio/pcma": (g711.alaw_encode, g711.alaw_decode),
    }[codec]
    formats = {"input": {"format": {"type": codec}}, "output": {"format": {"type": codec}}}
    async with realtime(gateway, audio=formats) as (connection, events):
        updated = events.of("session.updated")[-1]["session"]["audio"]
        assert updated["input"]["format"]["type"] == updated["output"]["format"]["type"] == codec
        clip = load_clip("spk1_snt1").to_rate(8000)
        data = encode(float_to_pcm16(np.concatenate([clip.samples, np.zeros(8000 * 3, np.float32)])))
        await stream(connection, data, rate_hz=8000, sample_bytes=1)
        done = await events.wait_for("response.done")
        transcript = (await events.wait_for("conversation.item.input_audio_transcription.completed"))["transcript"]
        assert "child" in transcript.lower()
        coded = audio_of(events, done["response"]["id"])
        assert_speech(decode(coded), 8000)


async def test_a_wrong_key_is_refused_and_the_subprotocol_key_is_heard(services) -> None:
    server = await start_gateway(services["asr"], services["llm"], services["tts"], auth_token="s3cret-token")
    try:
        client = AsyncOpenAI(api_key="wrong", websocket_base_url=ws_base(server))
        async with client.realtime.connect(model="voicemesh") as connection:
            event = json.loads(await connection.recv_bytes())
            SERVER_EVENT.validate_python(event)
            assert event["type"] == "error" and event["error"]["code"] == "invalid_api_key"
        url = f"http://127.0.0.1:{server.http_port}/v1/realtime"
        async with aiohttp.ClientSession() as http:
            protocols = ("realtime", "openai-insecure-api-key.s3cret-token")
            async with http.ws_connect(url, protocols=protocols) as ws:
                assert ws.protocol == "realtime"
                first = json.loads((await ws.receive(timeout=10)).data)
                assert first["type"] == "session.created"
    finally:
        await server.stop()


async def test_bad_input_gets_error_events_and_the_connection_goes_on(gateway) -> None:
    url = f"http://127.0.0.1:{gateway.http_port}/v1/realtime"
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:

        async def answer(message: str | dict[str, Any]) -> dict[str, Any]:
            await ws.send_str(message if isinstance(message, str) else json.dumps(message))
            reply = json.loads((await ws.receive(timeout=30)).data)
            SERVER_EVENT.validate_python(reply)
            return reply

        assert json.loads((await ws.receive(timeout=10)).data)["type"] == "session.created"
        cases: list[tuple[str | dict[str, Any], str]] = [
            ({"type": "no.such.event", "event_id": "e1"}, "unknown_event"),
            ("{not json", "invalid_json"),
            ({"type": "input_audio_buffer.append"}, "missing_required_parameter"),
            ({"type": "input_audio_buffer.append", "audio": "@@@not base64@@@"}, "invalid_value"),
            ({"type": "input_audio_buffer.append", "audio": "A" * (15 * 1024 * 1024 + 4)}, "invalid_value"),
            (
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(24000 * 2 * 5)).decode()},
                "audio_too_fast",
            ),
            (
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}},
                },
                "session_already_started",
            ),
            (
                {"type": "conversation.item.truncate", "item_id": "item_x", "content_index": 0, "audio_end_ms": 5},
                "item_not_found",
            ),
            (
                {
                    "type": "conversation.item.create",
                    "item": {"type": "function_call_output", "call_id": "c", "output": "{}"},
                },
                "not_supported",
            ),
            ({"type": "response.cancel"}, "response_cancel_not_active"),
        ]
        for message, code in cases:
            reply = await answer(message)
            assert reply["type"] == "error" and reply["error"]["code"] == code, (
                message if isinstance(message, str) else message.get("type"),
                reply,
            )
        assert (await answer({"type": "no.such.event", "event_id": "e1"}))["error"]["event_id"] == "e1"
        text = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}
        await ws.send_str(json.dumps({"type": "conversation.item.create", "item": text}))
        await ws.send_str(json.dumps({"type": "response.create"}))
        await ws.send_str(json.dumps({"type": "response.create"}))
        seen: list[dict[str, Any]] = []
        while not any(e["type"] == "response.done" for e in seen):
            event = json.loads((await ws.receive(timeout=60)).data)
            SERVER_EVENT.validate_python(event)
            seen.append(event)
        errors = [e["error"]["code"] for e in seen if e["type"] == "error"]
        assert errors == ["conversation_already_has_active_response"], errors
        assert seen[-1]["response"]["status"] == "completed"


async def test_a_voice_the_tts_does_not_serve_is_an_error_that_lists_those_it_serves(gateway) -> None:
    async with realtime(gateway) as (connection, events):
        await connection.session.update(session={"type": "realtime", "audio": {"output": {"voice": "alloy"}}})
        error = (await events.wait_for("error"))["error"]
        assert error["param"] == "session.audio.output.voice" and "en_US-joe-medium" in error["message"], error
        voice = {"type": "realtime", "audio": {"output": {"voice": "en_US-joe-medium"}}}
        await connection.session.update(session=voice)
        updated = await events.wait_for("session.updated", timeout_s=15)
        assert updated["session"]["audio"]["output"]["voice"] == "en_US-joe-medium", events.of("error")
