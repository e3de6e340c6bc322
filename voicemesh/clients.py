"""Thin async clients for the three services, used by the CLI, the gateway's tests and the benchmarks."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import grpc

from voicemesh.audio import FRAME_MS, Clip
from voicemesh.serving import channel_options
from voicemesh.tls import ClientTls, secure_channel
from voicemesh.v1 import asr_pb2, asr_pb2_grpc, audio_pb2, llm_pb2, llm_pb2_grpc, tts_pb2, tts_pb2_grpc


@dataclass(frozen=True)
class Credentials:
    """How a client reaches a server: TLS to check it (and, for mutual TLS, to be checked), and a bearer token."""

    tls: ClientTls | None = None
    token: str = ""

    def channel(self, target: str) -> grpc.aio.Channel:
        return secure_channel(target, self.tls, channel_options())

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the token, if any (never logged)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


PLAINTEXT = Credentials()


def epoch_us() -> int:
    return time.time_ns() // 1000


def new_session_id() -> str:
    return uuid.uuid4().hex[:16]


def pcm_frame(data: bytes, rate_hz: int, seq: int) -> audio_pb2.AudioFrame:
    return audio_pb2.AudioFrame(
        data=data,
        encoding=audio_pb2.AUDIO_ENCODING_PCM16LE,
        sample_rate_hz=rate_hz,
        seq=seq,
        capture_time_us=epoch_us(),
    )


class Pacer:
    """Real-time pace on an absolute schedule: the k-th `wait()` returns at start + k * 20 ms, so there is no drift."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._frames = 0

    async def wait(self) -> None:
        """Sleep until the next frame is due; return at once when running behind."""
        delay = self._start + self._frames * FRAME_MS / 1000 - time.monotonic()
        self._frames += 1
        if delay > 0:
            await asyncio.sleep(delay)


async def paced(frames: Iterable[bytes], realtime: bool = True) -> AsyncIterator[tuple[int, bytes]]:
    """Yield (index, frame) at real-time pace (a `Pacer`), or as fast as possible."""
    pacer = Pacer()
    for index, data in enumerate(frames):
        if realtime:
            await pacer.wait()
        yield index, data


def clip_with_silence(clip: Clip, rate_hz: int, silence_s: float) -> list[bytes]:
    """The clip at `rate_hz` in 20 ms frames, followed by `silence_s` of silence."""
    frames = clip.to_rate(rate_hz).frames()
    silent = b"\x00" * len(frames[0]) if frames else b"\x00" * (rate_hz * FRAME_MS // 1000 * 2)
    return frames + [silent] * int(silence_s * 1000 / FRAME_MS)


async def recognize(
    target: str,
    clip: Clip,
    rate_hz: int = 16000,
    realtime: bool = True,
    trailing_silence_s: float = 1.0,
    config: asr_pb2.RecognitionConfig | None = None,
    credentials: Credentials = PLAINTEXT,
) -> AsyncIterator[tuple[float, asr_pb2.RecognizeEvent]]:
    """Stream a clip into StreamingRecognize; yields (seconds since the first frame, event)."""
    cfg = asr_pb2.RecognitionConfig()
    if config is not None:
        cfg.CopyFrom(config)
    cfg.session_id = cfg.session_id or new_session_id()
    cfg.sample_rate_hz = rate_hz
    cfg.interim_results = True if config is None else cfg.interim_results
    frames = clip_with_silence(clip, rate_hz, trailing_silence_s)
    start = time.monotonic()

    async def requests() -> AsyncIterator[asr_pb2.RecognizeRequest]:
        yield asr_pb2.RecognizeRequest(config=cfg)
        async for index, data in paced(frames, realtime):
            yield asr_pb2.RecognizeRequest(frame=pcm_frame(data, rate_hz, index))

    async with credentials.channel(target) as channel:
        call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(requests(), metadata=credentials.metadata())
        async for event in call:
            yield time.monotonic() - start, event


async def generate(
    target: str,
    messages: list[tuple[llm_pb2.Role, str]],
    session_id: str = "",
    max_tokens: int = 0,
    credentials: Credentials = PLAINTEXT,
) -> AsyncIterator[llm_pb2.GenerateResponse]:
    """Stream a reply; `messages` are (llm_pb2.ROLE_*, text) pairs. The replica's keepalives (empty messages while
    the call waits) are not passed on."""
    request = llm_pb2.GenerateRequest(
        session_id=session_id or new_session_id(),
        messages=[llm_pb2.ChatMessage(role=role, content=text) for role, text in messages],
        max_tokens=max_tokens,
    )
    async with credentials.channel(target) as channel:
        async for response in llm_pb2_grpc.GeneratorStub(channel).Generate(request, metadata=credentials.metadata()):
            if response.ByteSize():
                yield response


async def synthesize(
    target: str,
    deltas: Iterable[str],
    rate_hz: int = 22050,
    chunking: tts_pb2.ChunkingPolicy = tts_pb2.CHUNKING_POLICY_WORDS,
    lookahead_words: int = 2,
    delta_interval_s: float = 0.0,
    credentials: Credentials = PLAINTEXT,
) -> AsyncIterator[tuple[float, tts_pb2.SynthesizeEvent]]:
    """Send text deltas (optionally spaced in time, like an LLM stream) and a flush; yields (seconds, event)."""
    config = tts_pb2.SynthesisConfig(
        session_id=new_session_id(),
        sample_rate_hz=rate_hz,
        encoding=audio_pb2.AUDIO_ENCODING_PCM16LE,
        chunking=chunking,
        lookahead_words=lookahead_words,
    )
    start = time.monotonic()

    async def requests() -> AsyncIterator[tts_pb2.SynthesizeRequest]:
        yield tts_pb2.SynthesizeRequest(config=config)
        for delta in deltas:
            yield tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=1, text=delta))
            if delta_interval_s:
                await asyncio.sleep(delta_interval_s)
        yield tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=1))

    async with credentials.channel(target) as channel:
        call = tts_pb2_grpc.SynthesizerStub(channel).StreamingSynthesize(requests(), metadata=credentials.metadata())
        async for event in call:
            yield time.monotonic() - start, event
