"""The gateway's view of the ASR, LLM and TTS replicas: long-lived channels, health, and which one to call.

LLM calls of a session go to the first healthy replica of its rendezvous ranking (its prefix/KV cache lives
there); a replica that refuses (RESOURCE_EXHAUSTED) or is unreachable hands the call to the next in the
ranking. ASR and TTS are stateless per call: the healthy replica with the fewest streams from this gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Iterator

import grpc
from grpc_health.v1 import health_pb2

from voicemesh.clients import PLAINTEXT, Credentials
from voicemesh.routing import ReplicaLoad, ReplicaSet
from voicemesh.serving import health_check
from voicemesh.v1 import asr_pb2_grpc, llm_pb2, llm_pb2_grpc, tts_pb2_grpc

log = logging.getLogger(__name__)

RETRY_ELSEWHERE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
HEALTH_TIMEOUT_S = 1.0
READY_TIMEOUT_S = 5.0  # a replica not connected by then is marked down and the session tries another


class Backends:
    """Replica sets and one channel per replica, shared by every session of this gateway."""

    def __init__(
        self,
        asr_spec: str,
        llm_spec: str,
        tts_spec: str,
        refresh_s: float = 10.0,
        health_interval_s: float = 2.0,
        credentials: Credentials = PLAINTEXT,
    ) -> None:
        self.credentials = credentials  # TLS to the services and the token they want
        self.sets = {
            "asr": ReplicaSet(asr_spec, refresh_s),
            "llm": ReplicaSet(llm_spec, refresh_s),
            "tts": ReplicaSet(tts_spec, refresh_s),
        }
        self.refresh_s = refresh_s
        self.health_interval_s = health_interval_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._maintenance: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Resolve the replica sets once, then keep them fresh and health-checked in the background."""
        for replicas in self.sets.values():
            await replicas.refresh()
        self._maintenance = asyncio.ensure_future(self._maintain())

    async def _maintain(self) -> None:
        since_refresh = 0.0
        while True:
            await asyncio.sleep(self.health_interval_s)
            since_refresh += self.health_interval_s
            if since_refresh >= self.refresh_s:
                since_refresh = 0.0
                for replicas in self.sets.values():
                    await replicas.refresh()
            await asyncio.gather(
                *(self._check(load) for replicas in self.sets.values() for load in replicas.replicas.values())
            )

    async def _check(self, load: ReplicaLoad) -> None:
        check = health_check(self.channel(load.target))
        try:
            reply = await check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
            healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            healthy = False
        if healthy != load.healthy:
            log.info("replica health changed", extra={"target": load.target, "healthy": healthy})
        load.healthy = healthy

    def channel(self, target: str) -> grpc.aio.Channel:
        if target not in self._channels:
            self._channels[target] = self.credentials.channel(target)
        return self._channels[target]

    def metadata(self, extra: list[tuple[str, str]] | None = None) -> tuple[tuple[str, str], ...]:
        """Call metadata for a service: its token, if any, and `extra` (a turn's trace context)."""
        return (*self.credentials.metadata(), *(extra or ()))

    def mark_down(self, stage: str, target: str) -> None:
        load = self.sets[stage].replicas.get(target)
        if load is not None:
            load.healthy = False

    # ---- stateless stages ---------------------------------------------------------------------------------
    def pick(self, stage: str) -> str:
        """ASR or TTS: the least-loaded healthy replica."""
        return self.sets[stage].least_loaded_order()[0]

    def candidates(self, stage: str) -> list[str]:
        return self.sets[stage].least_loaded_order()

    def recognizer(self, target: str) -> asr_pb2_grpc.RecognizerAsyncStub:
        return asr_pb2_grpc.RecognizerStub(self.channel(target))

    def synthesizer(self, target: str) -> tts_pb2_grpc.SynthesizerAsyncStub:
        return tts_pb2_grpc.SynthesizerStub(self.channel(target))

    @contextlib.contextmanager
    def streaming(self, stage: str, target: str) -> Iterator[None]:
        """Count a stream against its replica for least-loaded picking."""
        load = self.sets[stage].replicas.get(target)
        if load is not None:
            load.in_flight += 1
        try:
            yield
        finally:
            if load is not None:
                load.in_flight -= 1

    async def ready(self, target: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until the channel to `target` is connected (gRPC keeps retrying with backoff meanwhile).

        Past `timeout_s` the replica is marked down, so the next pick avoids it (a dead pod's address never comes
        back), and UNAVAILABLE is raised for the caller to report and retry."""
        try:
            await asyncio.wait_for(self.channel(target).channel_ready(), timeout_s)
        except TimeoutError:
            for stage, replicas in self.sets.items():
                if target in replicas.replicas:
                    self.mark_down(stage, target)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                f"{target} did not connect within {timeout_s:g} s",
            ) from None

    # ---- the sticky LLM --------------------------------------------------------------------------------
    def llm_order(self, session_id: str) -> list[str]:
        return self.sets["llm"].sticky_order(session_id)

    async def generate(
        self, request: llm_pb2.GenerateRequest, metadata: list[tuple[str, str]] | None = None
    ) -> AsyncGenerator[llm_pb2.GenerateResponse, None]:
        """Stream from the session's replica; refused or unreachable before the first token: the next one.

        `metadata` carries the turn's W3C trace context, so the replica's spans join the turn's trace.
        """
        last_error: grpc.aio.AioRpcError | None = None
        for target in self.llm_order(request.session_id):
            call = llm_pb2_grpc.GeneratorStub(self.channel(target)).Generate(request, metadata=self.metadata(metadata))
            try:
                try:
                    first = await anext(aiter(call))
                except StopAsyncIteration:
                    return
                except grpc.aio.AioRpcError as error:
                    if error.code() not in RETRY_ELSEWHERE:
                        raise
                    if error.code() == grpc.StatusCode.UNAVAILABLE:
                        self.mark_down("llm", target)
                    log.info(
                        "llm replica refused; trying the next", extra={"target": target, "code": error.code().name}
                    )
                    last_error = error
                    continue
                yield first
                async for response in call:
                    yield response
                return
            finally:
                call.cancel()  # no-op once finished; frees the replica's slot when the caller gave up
        if last_error is not None:
            raise last_error
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "no LLM replica configured"
        )

    async def close(self) -> None:
        if self._maintenance is not None:
            self._maintenance.cancel()
        for channel in self._channels.values():
            await channel.close()
