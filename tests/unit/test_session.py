"""Session orchestration with fake backends: what reaches the ASR stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from gateway.options import PipelineOptions, SessionOptions
from gateway.session import Session
from voicemesh.v1 import asr_pb2, audio_pb2, tts_pb2


class FakeStream:
    """A streaming RPC that records the requests and answers nothing until they end."""

    def __init__(self, requests: AsyncIterator[object], seen: list[object]) -> None:
        self._requests = requests
        self._seen = seen

    def __aiter__(self) -> AsyncIterator[object]:
        return self._run()

    async def _run(self) -> AsyncIterator[object]:
        async for request in self._requests:
            self._seen.append(request)
        return
        yield  # an async generator that yields nothing


class FakeStub:
    def __init__(self, seen: list[object]) -> None:
        self.seen = seen

    def StreamingRecognize(self, requests: AsyncIterator[object]) -> FakeStream:
        return FakeStream(requests, self.seen)

    StreamingSynthesize = StreamingRecognize


class FakeBackends:
    """Backends whose first connection takes a while, as a real channel's does."""

    def __init__(self, connect_s: float) -> None:
        self.connect_s = connect_s
        self.asr: list[object] = []
        self.tts: list[object] = []

    def pick(self, stage: str) -> str:
        return stage

    def candidates(self, stage: str) -> list[str]:
        return [stage]

    async def ready(self, target: str) -> None:
        await asyncio.sleep(self.connect_s)

    def recognizer(self, target: str) -> FakeStub:
        return FakeStub(self.asr)

    def synthesizer(self, target: str) -> FakeStub:
        return FakeStub(self.tts)

    @contextlib.contextmanager
    def streaming(self, stage: str, target: str) -> Iterator[None]:
        yield


async def test_frames_sent_while_the_asr_stream_connects_are_not_lost() -> None:
    backends = FakeBackends(connect_s=0.1)
    options = SessionOptions("s1", 16000, 16000, "", "", PipelineOptions())
    session = Session(options, backends, history=[])  # type: ignore[arg-type]
    for index in range(10):  # 200 ms of audio before the ASR stream is up
        session.push_frame(audio_pb2.AudioFrame(data=bytes([index]) * 640, seq=index, capture_time_us=1000 + index))
    await asyncio.sleep(0.2)
    for index in range(10, 15):
        session.push_frame(audio_pb2.AudioFrame(data=bytes([index]) * 640, seq=index, capture_time_us=1000 + index))
    await asyncio.wait_for(session.finish(), 5)
    await session.close()
    requests = [r for r in backends.asr if isinstance(r, asr_pb2.RecognizeRequest)]
    assert requests[0].WhichOneof("request") == "config"
    frames = [r.frame for r in requests[1:]]
    assert [f.seq for f in frames] == list(range(15))
    assert [f.data[0] for f in frames] == list(range(15))  # in order, none lost
    assert [f.capture_time_us for f in frames] == [1000 + i for i in range(15)]
    assert isinstance(backends.tts[0], tts_pb2.SynthesizeRequest)
