"""Persistent channels from the gateway to the ASR, LLM and TTS services: one each, shared by all sessions."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from voicemesh.serving import channel_options
from voicemesh.v1 import asr_pb2_grpc, llm_pb2_grpc, tts_pb2_grpc


@dataclass
class Backends:
    """Stubs over long-lived channels; gRPC reconnects them by itself after a service restart."""

    asr_target: str
    llm_target: str
    tts_target: str

    def __post_init__(self) -> None:
        options = channel_options()
        self._channels = [
            grpc.aio.insecure_channel(t, options=options) for t in (self.asr_target, self.llm_target, self.tts_target)
        ]
        self.asr = asr_pb2_grpc.RecognizerStub(self._channels[0])
        self.llm = llm_pb2_grpc.GeneratorStub(self._channels[1])
        self.tts = tts_pb2_grpc.SynthesizerStub(self._channels[2])

    async def ready(self, stage: str) -> None:
        """Wait until the stage's channel is connected (gRPC keeps retrying with backoff meanwhile)."""
        await self._channels[("asr", "llm", "tts").index(stage)].channel_ready()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
