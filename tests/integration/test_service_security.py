"""A service behind mutual TLS and a token, as the gateway reaches it in a cluster: every door refuses a caller
without the credential, probes still work on the plaintext health port, and /metrics wants the token too."""

from __future__ import annotations

import asyncio
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from voicemesh import clients
from voicemesh.clients import Credentials
from voicemesh.mesh import Mesh, free_port, wait_healthy
from voicemesh.serving import channel_options, health_check
from voicemesh.tls import ClientTls, local_certificates

pytestmark = pytest.mark.integration

TOKEN = "service-token-for-tests"


@dataclass(frozen=True)
class SecuredService:
    target: str
    health_target: str
    metrics_url: str
    client: ClientTls
    ca_file: str


@pytest.fixture(scope="module")
def secured_tts() -> Iterator[SecuredService]:
    directory = Path(tempfile.mkdtemp(prefix="voicemesh-tls-"))
    certs = local_certificates(directory)
    port, health_port, metrics_port = free_port(), free_port(), free_port()
    mesh = Mesh(log_dir=str(directory / "logs"))
    server = certs.server
    process = mesh.start(
        "tts",
        port,
        [
            f"--tls-cert={server.cert_file}",
            f"--tls-key={server.key_file}",
            f"--tls-client-ca={certs.ca_file}",
            f"--health-port={health_port}",
            f"--metrics-port={metrics_port}",
            f"--auth-token={TOKEN}",
        ],
    )
    try:

        async def ready() -> None:
            waiting = asyncio.ensure_future(wait_healthy(f"127.0.0.1:{health_port}", 120))
            while not waiting.done():
                assert process.popen.poll() is None, "the TLS service exited while starting; see its log"
                await asyncio.sleep(0.2)
            waiting.result()

        asyncio.run(ready())
        yield SecuredService(
            process.target,
            f"127.0.0.1:{health_port}",
            f"http://127.0.0.1:{metrics_port}/metrics",
            certs.client,
            certs.ca_file,
        )
    finally:
        mesh.stop_all()


async def _say(service: SecuredService, credentials: Credentials) -> int:
    frames = 0
    async for _, event in clients.synthesize(service.target, ["Hello", " there."], credentials=credentials):
        frames += event.WhichOneof("event") == "audio"
    return frames


async def test_a_caller_with_the_certificate_and_the_token_is_served(secured_tts: SecuredService) -> None:
    assert await _say(secured_tts, Credentials(secured_tts.client, TOKEN)) > 10


@pytest.mark.parametrize("token", ["", "wrong-token"], ids=["no-token", "wrong-token"])
async def test_a_caller_without_the_token_gets_a_bare_unauthenticated(secured_tts: SecuredService, token: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _say(secured_tts, Credentials(secured_tts.client, token))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert refused.value.details() == "unauthenticated"  # no hint of what was wrong


async def test_a_caller_without_a_client_certificate_or_without_tls_cannot_connect(
    secured_tts: SecuredService,
) -> None:
    for credentials in (Credentials(ClientTls(secured_tts.ca_file), TOKEN), Credentials(None, TOKEN)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(_say(secured_tts, credentials), 20)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_probes_use_the_plaintext_health_port_which_serves_nothing_else(secured_tts: SecuredService) -> None:
    async with grpc.aio.insecure_channel(secured_tts.health_target, options=channel_options()) as channel:
        reply = await health_check(channel)(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # The synthesizer is not there (one message and a half-close: no race with the early status).
        synthesize = channel.unary_unary("/voicemesh.v1.Synthesizer/StreamingSynthesize")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await synthesize(b"")
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_metrics_want_the_token_and_count_the_refusals(secured_tts: SecuredService) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(secured_tts.metrics_url, timeout=10)
    assert refused.value.code == 401 and refused.value.read() == b""
    request = urllib.request.Request(secured_tts.metrics_url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read().decode()
    assert 'voicemesh_unauthenticated_total{door="metrics"} 1.0' in body
    assert 'voicemesh_unauthenticated_total{door="synthesizer"}' in body
