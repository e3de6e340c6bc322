"""A refusal reaches a streaming client as what it is: a client still writing when its call ends sees INTERNAL
"Internal error from Core" instead of the status (grpc/grpc#36066), so every refusal of a streaming call reads the
caller's writing to a pause first. Real clients flood real servers, ten times each, since the race shows in some runs
only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from tests.integration.helpers import start_offline_gateway
from voicemesh.clients import pcm_frame
from voicemesh.errors import RequestError
from voicemesh.serving import merge_reader, stream_handler
from voicemesh.v1 import asr_pb2, asr_pb2_grpc, conversation_pb2, conversation_pb2_grpc

pytestmark = pytest.mark.integration

RUNS = 10
FLOOD_FRAMES = 200  # 100 ms each: 20 s of audio written as fast as the channel takes it
CHUNK = b"\x00\x00" * 1600


async def flooded(call: Callable[[AsyncIterator[Any]], AsyncIterator[object]], first: Any) -> tuple[str, str]:
    """The status a client sees that sends `first`, then FLOOD_FRAMES frames with no pause between them, and then
    keeps its stream open until the call ends."""
    ended = asyncio.Event()

    async def flood() -> AsyncIterator[Any]:
        yield first
        for seq in range(FLOOD_FRAMES):
            yield type(first)(frame=pcm_frame(CHUNK, 16000, seq))
        await ended.wait()

    try:
        async for _ in call(flood()):
            pass
    except grpc.aio.AioRpcError as error:
        return error.code().name, error.details() or ""
    finally:
        ended.set()
    return "OK", ""


async def test_a_flood_of_audio_into_the_gateway_is_refused_as_resource_exhausted_every_time() -> None:
    server = await start_offline_gateway(http_port=-1)
    seen = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = conversation_pb2_grpc.ConversationStub(channel)
            for run in range(RUNS):
                config = conversation_pb2.SessionConfig(session_id=f"flood-{run}", input_sample_rate_hz=16000)
                request = conversation_pb2.ConverseRequest(config=config)
                seen.append(await flooded(stub.Converse, request))
    finally:
        await server.stop()
    codes = [code for code, _ in seen]
    assert codes == ["RESOURCE_EXHAUSTED"] * RUNS, codes
    assert all("faster than real time" in details for _, details in seen), seen


class RefusingRecognizer(asr_pb2_grpc.RecognizerServicer):
    """A recognizer whose call is refused after `after` frames: by its reader (bad input), or by its events (work
    behind the call failed while the reader waited for the next frame)."""

    def __init__(self, after: int, from_events: bool) -> None:
        self.after = after
        self.from_events = from_events

    @stream_handler
    async def StreamingRecognize(
        self, request_iterator: AsyncIterator[asr_pb2.RecognizeRequest], context: object
    ) -> AsyncIterator[asr_pb2.RecognizeResponse]:
        events: asyncio.Queue[object] = asyncio.Queue()
        refusal = RequestError(grpc.StatusCode.INVALID_ARGUMENT, "frame refused; send fewer")

        async def read() -> None:
            frames = 0
            async for request in request_iterator:
                frames += request.HasField("frame")
                if frames == self.after:
                    if not self.from_events:
                        raise refusal
                    events.put_nowait(refusal)

        async for event in merge_reader(read(), events):
            yield event


@pytest.mark.parametrize("from_events", [False, True], ids=["by_the_reader", "by_the_events"])
async def test_a_streaming_service_refusing_a_flood_is_heard_as_its_status_every_time(from_events: bool) -> None:
    server = grpc.aio.server()
    asr_pb2_grpc.add_RecognizerServicer_to_server(RefusingRecognizer(after=20, from_events=from_events), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    seen = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = asr_pb2_grpc.RecognizerStub(channel)
            for run in range(RUNS):
                config = asr_pb2.RecognitionConfig(session_id=f"flood-{run}", sample_rate_hz=16000)
                request = asr_pb2.RecognizeRequest(config=config)
                seen.append(await flooded(stub.StreamingRecognize, request))
    finally:
        await server.stop(0)
    assert seen == [("INVALID_ARGUMENT", "frame refused; send fewer")] * RUNS, seen
