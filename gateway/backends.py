"""The gateway's view of the ASR, LLM and TTS replicas: long-lived channels, health, and which one to call.

LLM calls of a session go to the first healthy replica of its rendezvous ranking (its prefix/KV cache lives
there); a replica that refuses (RESOURCE_EXHAUSTED) or is unreachable hands the call to the next in the
ranking. ASR and TTS are stateless per call: the healthy replica with the fewest streams from this gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Iterator

import grpc
from grpc_health.v1 import health_pb2

from gateway.streams import Backoff, Silence, replica_failed, unavailable, watched
from voicemesh import telemetry
from voicemesh.clients import PLAINTEXT, Credentials
from voicemesh.limits import MAX_TOKENS
from voicemesh.routing import ReplicaLoad, ReplicaSet
from voicemesh.serving import health_check
from voicemesh.v1 import asr_pb2_grpc, llm_pb2, llm_pb2_grpc, tts_pb2_grpc

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 1.0
READY_TIMEOUT_S = 5.0  # a replica not connected by then is marked down and the session tries another
LLM_FIRST_TOKEN_TIMEOUT_S = 10.0  # a queue of other sessions' replies included; past it, the next replica
# Tokens come every ~30 ms, and a call waiting for them gets a keepalive every 250 ms: this long with no message at all,
# before the first token as after it, is a hung replica (SIGSTOP, a wedged event loop).
LLM_STALL_S = 1.0
LLM_CALL_DEADLINE_S = 60.0  # the longest reply (512 tokens) takes ~15 s on 2 cores
LLM_PREFILL_DEADLINE_S = 2.0  # a prefill takes tens of ms; one much later is of no use to its turn
SATURATED_RETRY_S = (0.25, 1.0)  # every LLM replica refused as full: the next round after this (doubling)


def continuation(request: llm_pb2.GenerateRequest, said: list[str]) -> llm_pb2.GenerateRequest:
    """The request that replays a reply on another replica: it continues from the deltas `said` so far."""
    attempt = llm_pb2.GenerateRequest()
    attempt.CopyFrom(request)
    attempt.reply_prefix = "".join(said)
    attempt.max_tokens = max(1, (request.max_tokens or MAX_TOKENS.default) - len(said))
    return attempt


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
        # LLM replicas whose engine never prefills (one older than prefills on vLLM, say), as they said: no more
        # Prefills go to them. A new replica (another address) is asked again.
        self.llm_prefill_unsupported: set[str] = set()

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
        """Suspect `target` at once (it failed, timed out or refused): picks avoid it until a health check passes."""
        load = self.sets[stage].replicas.get(target)
        if load is not None:
            if load.healthy:
                log.info("replica suspect", extra={"stage": stage, "target": target})
            load.healthy = False

    # ---- stateless stages ---------------------------------------------------------------------------------
    def pick(self, stage: str) -> str:
        """ASR or TTS: the least-loaded healthy replica (UNAVAILABLE when the set is empty, e.g. DNS found none)."""
        order = self.sets[stage].least_loaded_order()
        if not order:
            raise unavailable(f"no {stage.upper()} replica is known (its replica set is empty)")
        return order[0]

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
        """Wait until the channel to `target` is connected.

        A connection that fails (a killed replica refuses it) marks the replica down at once, and so does one not
        made within `timeout_s` (a dead pod's address never answers): the next pick avoids it. Either way
        UNAVAILABLE is raised for the caller to report and retry."""
        channel = self.channel(target)
        try:
            async with asyncio.timeout(timeout_s):
                state = channel.get_state(try_to_connect=True)
                while state != grpc.ChannelConnectivity.READY:
                    if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                        self._mark_down_everywhere(target)
                        raise unavailable(f"{target} refused the connection")
                    await channel.wait_for_state_change(state)
                    state = channel.get_state(try_to_connect=True)
        except TimeoutError:
            self._mark_down_everywhere(target)
            raise unavailable(f"{target} did not connect within {timeout_s:g} s") from None

    def _mark_down_everywhere(self, target: str) -> None:
        for stage, replicas in self.sets.items():
            if target in replicas.replicas:
                self.mark_down(stage, target)

    # ---- the sticky LLM --------------------------------------------------------------------------------
    def llm_order(self, session_id: str) -> list[str]:
        return self.sets["llm"].sticky_order(session_id)

    async def prefill(self, request: llm_pb2.PrefillRequest) -> llm_pb2.PrefillResponse | None:
        """Load a session's dialogue into the cache of the replica its next Generate goes to first; None: that
        replica said its engine never prefills. No failover: a failure only costs the reply the evaluation this
        would have saved it."""
        ranking = self.llm_order(request.session_id)
        if not ranking:
            raise unavailable("no LLM replica is up")
        target = ranking[0]
        if target in self.llm_prefill_unsupported:
            return None
        call = llm_pb2_grpc.GeneratorStub(self.channel(target)).Prefill
        response = await call(request, metadata=self.metadata(), timeout=LLM_PREFILL_DEADLINE_S)
        if response.unsupported:
            log.info("the LLM replica never prefills; no more prefills go to it", extra={"target": target})
            self.llm_prefill_unsupported.add(target)
        return response

    async def generate(
        self,
        request: llm_pb2.GenerateRequest,
        metadata: list[tuple[str, str]] | None = None,
        first_token_timeout_s: float = LLM_FIRST_TOKEN_TIMEOUT_S,
        stall_s: float = LLM_STALL_S,
    ) -> AsyncGenerator[llm_pb2.GenerateResponse, None]:
        """Stream the reply from the session's replica, failing over down its ranking.

        A replica that fails, sends nothing at all for `stall_s` (it sends keepalives while it waits), or no first
        token within `first_token_timeout_s`, is marked suspect and the call goes to the next one; one that refuses as
        full is skipped, and when all are full the round is tried again shortly, within `first_token_timeout_s`.
        Keepalives are not passed on. After text has streamed, the next replica continues the reply from it
        (`reply_prefix`), so no word is repeated. `metadata` carries the turn's W3C trace context, so the replica's
        spans join the turn's trace.
        """
        said: list[str] = []
        started = time.monotonic()
        backoff = Backoff(*SATURATED_RETRY_S)
        failed: set[str] = set()  # replicas that failed this call (not merely full)
        while True:
            last_error: grpc.aio.AioRpcError | None = None
            saturated = False
            ranking = self.llm_order(request.session_id)
            order = [t for t in ranking if t not in failed] or ranking
            for target in order:
                attempt = continuation(request, said) if said else request
                call = llm_pb2_grpc.GeneratorStub(self.channel(target)).Generate(
                    attempt, metadata=self.metadata(metadata), timeout=LLM_CALL_DEADLINE_S
                )
                silence = Silence("LLM", first_s=first_token_timeout_s, quiet_s=stall_s)
                try:
                    async for response in watched(call, silence.problem):
                        # A score is not a token: the first-token limit holds.
                        silence.heard(content=bool(response.text_delta or response.finish_reason))
                        if not response.ByteSize():
                            continue  # a keepalive: the replica is alive, and the session has nothing to do
                        if response.text_delta:
                            said.append(response.text_delta)
                        yield response
                    return
                except grpc.aio.AioRpcError as error:
                    if not replica_failed(error):
                        raise
                    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        saturated = True  # a full replica is healthy: only skipped for this round
                    else:
                        self.mark_down("llm", target)
                        failed.add(target)
                        telemetry.FAILOVERS.labels("llm").inc()
                    log.info(
                        "llm replica failed; trying the next",
                        extra={
                            "target": target,
                            "code": error.code().name,
                            "detail": error.details(),
                            "continuing": bool(said),
                        },
                    )
                    last_error = error
                finally:
                    call.cancel()  # no-op once finished; frees the replica's slot when the caller gave up
            if last_error is None:
                raise unavailable("no LLM replica is known (its replica set is empty)")
            # A replica left out of this round as suspect (it stalled or failed a moment ago, and no health check has
            # cleared it yet) is tried once every replica in the round has failed: the ranking then falls back to all.
            if any(t not in failed and t not in order for t in self.llm_order(request.session_id)):
                continue
            # Every replica is full (one of them down, say, and the rest carrying its sessions): wait for a slot
            # rather than lose the turn, within the first-token limit.
            if not saturated or time.monotonic() - started + backoff.delay_s > first_token_timeout_s:
                raise last_error
            await backoff.wait()

    async def close(self) -> None:
        if self._maintenance is not None:
            self._maintenance.cancel()
        for channel in self._channels.values():
            await channel.close()
