"""Fake ASR, LLM and TTS backends for sessions in unit tests: the test scripts the ASR's events, the LLM says a fixed
reply, the TTS speaks each word as FRAMES_PER_WORD frames."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from voicemesh.v1 import asr_pb2, audio_pb2, llm_pb2, tts_pb2

FRAMES_PER_WORD = 3


class FakeRecognize:
    """A StreamingRecognize call: records the requests, and yields the events the test scripts until they end."""

    def __init__(self, requests: AsyncIterator[object], seen: list[object], script: asyncio.Queue) -> None:
        self._requests = requests
        self._seen = seen
        self._script = script

    def __aiter__(self) -> AsyncIterator[object]:
        return self._run()

    async def _run(self) -> AsyncIterator[object]:
        reader = asyncio.ensure_future(self._read())
        try:
            while (event := await self._script.get()) is not None:
                yield event
        finally:
            reader.cancel()

    async def _read(self) -> None:
        async for request in self._requests:
            self._seen.append(request)
        self._script.put_nowait(None)


class FakeSynthesize:
    """A StreamingSynthesize call: on each flush, FRAMES_PER_WORD frames per word of the utterance, then done."""

    def __init__(self, requests: AsyncIterator[tts_pb2.SynthesizeRequest], seen: list[object]) -> None:
        self._requests = requests
        self._seen = seen

    def __aiter__(self) -> AsyncIterator[tts_pb2.SynthesizeEvent]:
        return self._run()

    async def _run(self) -> AsyncIterator[tts_pb2.SynthesizeEvent]:
        words: dict[int, list[str]] = {}
        async for request in self._requests:
            self._seen.append(request)
            kind = request.WhichOneof("request")
            if kind == "text":
                words.setdefault(request.text.utterance_id, []).extend(request.text.text.split())
            elif kind == "flush":
                utterance_id = request.flush.utterance_id
                for word in words.pop(utterance_id, []):
                    for index in range(FRAMES_PER_WORD):
                        frame = audio_pb2.AudioFrame(data=b"\x01\x00" * 320, sample_rate_hz=16000)
                        speech = tts_pb2.SpeechFrame(
                            utterance_id=utterance_id, frame=frame, text=word, chunk_end=index == FRAMES_PER_WORD - 1
                        )
                        yield tts_pb2.SynthesizeEvent(audio=speech)
                yield tts_pb2.SynthesizeEvent(done=tts_pb2.UtteranceDone(utterance_id=utterance_id))


class FakeStub:
    def __init__(self, backends: FakeBackends) -> None:
        self.backends = backends

    def StreamingRecognize(self, requests: AsyncIterator[object], metadata: object = None) -> FakeRecognize:
        return FakeRecognize(requests, self.backends.asr, self.backends.asr_script)

    def StreamingSynthesize(
        self, requests: AsyncIterator[tts_pb2.SynthesizeRequest], metadata: object = None
    ) -> FakeSynthesize:
        self.backends.tts_connected = True
        return FakeSynthesize(requests, self.backends.tts)


class FakeBackends:
    """Backends whose first connection takes a while, as a real channel's does; the LLM says `reply`."""

    def __init__(
        self, connect_s: float = 0.0, reply: str = "Hello there friend.", turn_end: float | None = None
    ) -> None:
        self.connect_s = connect_s
        self.reply = reply
        self.turn_end = turn_end  # the LLM's P(turn end) when asked to score; None: it cannot score
        self.asr: list[object] = []
        self.tts: list[object] = []
        self.asr_script: asyncio.Queue[asr_pb2.RecognizeEvent | None] = asyncio.Queue()
        self.tts_connected = False
        self.prefills: list[llm_pb2.PrefillRequest] = []
        self.prefill_error: grpc.aio.AioRpcError | None = None  # every prefill fails with it
        self.prefill_turn_end: float | None = None  # the P(turn end) a prefill reports of its words; None: none
        self.generates: list[llm_pb2.GenerateRequest] = []

    def forget(self) -> None:
        """Drop the fakes' own record of what they were sent (a long test keeps only the session's memory)."""
        for record in (self.asr, self.tts, self.prefills, self.generates):
            record.clear()

    def pick(self, stage: str) -> str:
        return stage

    def candidates(self, stage: str) -> list[str]:
        return [stage]

    async def ready(self, target: str) -> None:
        await asyncio.sleep(self.connect_s)

    def recognizer(self, target: str) -> FakeStub:
        return FakeStub(self)

    def metadata(self, extra: list[tuple[str, str]] | None = None) -> tuple[tuple[str, str], ...]:
        return tuple(extra or ())

    synthesizer = recognizer

    @contextlib.contextmanager
    def streaming(self, stage: str, target: str) -> Iterator[None]:
        yield

    async def prefill(self, request: llm_pb2.PrefillRequest) -> llm_pb2.PrefillResponse:
        self.prefills.append(request)
        if self.prefill_error is not None:
            raise self.prefill_error
        response = llm_pb2.PrefillResponse(evaluated_tokens=len(request.messages[-1].content.split()))
        if self.prefill_turn_end is not None:
            response.turn_end.probability = self.prefill_turn_end
        return response

    async def generate(
        self, request: llm_pb2.GenerateRequest, metadata: object = None
    ) -> AsyncIterator[llm_pb2.GenerateResponse]:
        """The reply a word a token: after `reply_prefix`'s words, at most `max_tokens` of them."""
        self.generates.append(request)
        if request.score_turn_end and self.turn_end is not None:
            yield llm_pb2.GenerateResponse(turn_end=llm_pb2.TurnEnd(probability=self.turn_end))
        said = len(request.reply_prefix.split())
        words = self.reply.split()[said:]
        cut = bool(request.max_tokens) and len(words) > request.max_tokens
        words = words[: request.max_tokens] if cut else words
        for index, word in enumerate(words):
            yield llm_pb2.GenerateResponse(text_delta=word if index == 0 and not said else f" {word}")
        yield llm_pb2.GenerateResponse(
            finish_reason=llm_pb2.FINISH_REASON_LENGTH if cut else llm_pb2.FINISH_REASON_STOP,
            usage=llm_pb2.Usage(prompt_tokens=20, completion_tokens=len(words)),
        )

    def say(self, **event: object) -> None:
        """The ASR reports `event` (speech_started=..., endpoint_candidate=..., final=..., partial=...)."""
        self.asr_script.put_nowait(asr_pb2.RecognizeEvent(**event))


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)
