"""Health, reflection and graceful drain of a real service process."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import free_port
from voicemesh import clients
from voicemesh.v1 import tts_pb2

pytestmark = pytest.mark.integration


async def test_every_service_reports_serving_per_service_name(services: dict[str, str]) -> None:
    names = {"asr": "voicemesh.v1.Recognizer", "llm": "voicemesh.v1.Generator", "tts": "voicemesh.v1.Synthesizer"}
    for kind, service_name in names.items():
        async with grpc.aio.insecure_channel(services[kind]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("", service_name):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def ask():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            async for answer in reflection.ServerReflectionInfo(ask()):
                listed = {s.name for s in answer.list_services_response.service}
                assert service_name in listed and "grpc.health.v1.Health" in listed


async def test_not_serving_until_the_model_is_loaded() -> None:
    from voicemesh.config import ServerSettings
    from voicemesh.serving import Server

    loaded = asyncio.Event()
    server = Server(ServerSettings(port=0), ["voicemesh.v1.Synthesizer"], lambda _: None, loaded.wait)
    starting = asyncio.ensure_future(server.start())
    while server.port == 0:
        await asyncio.sleep(0.01)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="voicemesh.v1.Synthesizer")
        reply = await stub.Check(request, wait_for_ready=True)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        loaded.set()
        await starting
        assert (await stub.Check(request)).status == health_pb2.HealthCheckResponse.SERVING
        await server.stop()


async def test_serving_process_drains_in_flight_streams_on_sigterm() -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "voicemesh.cli", "serve", "tts", "--port", str(port)])
    try:
        statuses = []
        async with grpc.aio.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(300):
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    statuses.append(reply.status)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.05)
        assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING

        # A stream in flight when SIGTERM arrives still completes within the drain grace period.
        async def synthesize() -> list:
            return [
                e
                async for e in clients.synthesize(
                    target, ["Draining ", "gracefully ", "works."], 16000, tts_pb2.CHUNKING_POLICY_WORDS, 2, 0.2
                )
            ]

        in_flight = asyncio.ensure_future(synthesize())
        await asyncio.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        events = await in_flight
        assert events[-1][1].WhichOneof("event") == "done"
        assert await asyncio.to_thread(process.wait, 15) == 0
    finally:
        if process.poll() is None:
            process.kill()


SERVING_PROCESS = """
import asyncio, gc, json, os, signal
import numpy, threadpoolctl
from voicemesh.config import ServerSettings
from voicemesh.serving import Server

async def main() -> None:
    server = Server(ServerSettings(port=0), ["voicemesh.v1.Synthesizer"], lambda _: None)
    async def look() -> None:
        while server.port == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        serving = [pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"]
        print(json.dumps({"frozen": gc.get_freeze_count(), "blas_serving": serving}), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    watcher = asyncio.ensure_future(look())
    await server.run_until_signal()
    await watcher

asyncio.run(main())
"""


def test_a_serving_process_freezes_its_startup_heap_and_runs_numpy_on_one_thread() -> None:
    """A full collection never walks the process's startup heap again (it stalled the gateway's event loop), and
    numpy's BLAS keeps no spinning thread per core beside the engines' own threads."""
    done = subprocess.run([sys.executable, "-c", SERVING_PROCESS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["frozen"] > 10_000, seen
    assert seen["blas_serving"] == [1], seen
