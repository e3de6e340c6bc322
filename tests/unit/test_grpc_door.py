"""The gRPC door without a network: Converse plays the reply into its stream at real time, in order with the events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.grpc_door import ConversationServicer
from gateway.registry import SessionRegistry
from gateway.settings import GatewaySettings
from tests.unit.fake_backends import FRAMES_PER_WORD, FakeBackends
from voicemesh.v1 import asr_pb2, conversation_pb2


class FakeContext:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


async def test_converse_plays_the_reply_at_real_time_and_its_last_frame_comes_before_reply_done() -> None:
    backends = FakeBackends(reply="Hello there friend.")
    registry = SessionRegistry(GatewaySettings())
    registry.backends = backends  # type: ignore[assignment]  # FakeBackends fakes the three streams; no Backends
    done = asyncio.Event()

    async def requests() -> AsyncIterator[conversation_pb2.ConverseRequest]:
        yield conversation_pb2.ConverseRequest(config=conversation_pb2.SessionConfig(input_sample_rate_hz=16000))
        await asyncio.sleep(0.05)
        backends.say(speech_started=asr_pb2.SpeechStarted())
        backends.say(final=asr_pb2.Final(text="what time is it"))
        await done.wait()  # the user's side stays open until the reply was heard

    received: list[tuple[str, float]] = []
    loop = asyncio.get_running_loop()
    async for event in ConversationServicer(registry).Converse(requests(), FakeContext()):
        kind = event.WhichOneof("event")
        received.append((kind, loop.time()))
        if kind == "reply_done":
            done.set()
    kinds = [kind for kind, _ in received]
    audio = [at for kind, at in received if kind == "reply_audio"]
    assert kinds[:2] == ["started", "user_final"]
    assert len(audio) == 3 * FRAMES_PER_WORD
    assert kinds[-3:] == ["reply_audio", "reply_done", "metrics"], kinds
    assert audio[-1] - audio[0] >= 0.05, "after the lead, one frame per 20 ms"
    assert not registry.active, "the session ended with the call"
