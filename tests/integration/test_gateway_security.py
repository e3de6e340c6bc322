"""The gateway's doors with credentials on: each refuses a caller without one (bare UNAUTHENTICATED or 401),
sessions belong to their owner, a bad offer leaks no slot, starts are rate-limited, no credential reaches the
logs; and a real turn over TLS to the gateway and mutual TLS plus a token to every service."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import grpc
import jwt
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from gateway.server import GatewayServer
from tests.conftest import load_clip
from tests.integration.helpers import expect_error, requests, start_gateway, start_offline_gateway
from voicemesh import clients
from voicemesh.auth import issue_token
from voicemesh.clients import Credentials
from voicemesh.conversation import ReplyAudio, talk
from voicemesh.mesh import Mesh, free_port, wait_healthy
from voicemesh.tls import ClientTls, LocalCertificates, local_certificates
from voicemesh.v1 import conversation_pb2, conversation_pb2_grpc, llm_pb2

pytestmark = pytest.mark.integration

KEYS = "k1:" + "1" * 32
STATIC = "static-token-for-tests"
TURN_SECRET = "turn-shared-secret"
RATE_HZ = 16000


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def config(session_id: str = "", resume_token: str = "") -> conversation_pb2.ConverseRequest:
    return conversation_pb2.ConverseRequest(
        config=conversation_pb2.SessionConfig(
            session_id=session_id, input_sample_rate_hz=RATE_HZ, resume_token=resume_token
        )
    )


@pytest_asyncio.fixture(loop_scope="session")
async def gateway() -> AsyncIterator[GatewayServer]:
    server = await start_offline_gateway(
        jwt_keys=KEYS,
        auth_token=STATIC,
        turn_secret=TURN_SECRET,
        turn_urls="turn:turn.example:3478",
    )
    yield server
    await server.stop()


async def _converse(server: GatewayServer, metadata: tuple[tuple[str, str], ...], request: object) -> object:
    """The first event of a Converse call, or the error it ended with (the call is cancelled afterwards)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = conversation_pb2_grpc.ConversationStub(channel).Converse(requests(request, hold=True), metadata=metadata)
        try:
            return await anext(aiter(call))
        except grpc.aio.AioRpcError as error:
            return error
        finally:
            call.cancel()


async def test_converse_wants_a_valid_token(gateway: GatewayServer) -> None:
    expired = jwt.encode({"sub": "alice", "exp": int(time.time()) - 120}, "1" * 32, algorithm="HS256")
    forged = jwt.encode({"sub": "alice", "exp": int(time.time()) + 60}, "2" * 32, algorithm="HS256")
    for metadata in ((), bearer("wrong"), bearer(expired), bearer(forged)):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            call = conversation_pb2_grpc.ConversationStub(channel).Converse(
                requests(config(), hold=True), metadata=metadata
            )
            await expect_error(call, grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")
    for token in (STATIC, issue_token(KEYS, "alice", 60)):
        first = await _converse(gateway, bearer(token), config())
        assert isinstance(first, conversation_pb2.ConverseEvent) and first.started.resume_token


async def test_browser_doors_and_metrics_want_a_credential(gateway: GatewayServer) -> None:
    base = f"http://127.0.0.1:{gateway.http_port}"
    token = issue_token(KEYS, "alice", 60)
    async with aiohttp.ClientSession() as client:
        async with client.get(f"{base}/api/config") as reply:
            assert reply.status == 401 and (await reply.json())["error"]["message"] == "unauthenticated"
        async with client.get(f"{base}/api/config", headers={"Authorization": f"Bearer {token}"}) as reply:
            page = await reply.json()
        (turn,) = [server for server in page["ice_servers"] if server.get("username")]
        expiry, _, subject = turn["username"].partition(":")
        assert subject == "alice" and 0 < int(expiry) - time.time() <= 3600 and turn["credential"]
        async with client.post(f"{base}/api/offer", json={"type": "offer", "sdp": "v=0", "config": {}}) as reply:
            assert reply.status == 401
        for start in ({"type": "start", "config": {}}, {"type": "start", "token": "wrong", "config": {}}):
            ws = await client.ws_connect(f"{base}/api/ws")
            await ws.send_str(json.dumps(start))
            assert json.loads((await ws.receive()).data)["code"] == "UNAUTHENTICATED"
            assert (await ws.receive()).data == 4401
    # (The /metrics door is the same code in every process: tests/integration/test_service_security.py.)
    unauthenticated = {
        door: REGISTRY.get_sample_value("voicemesh_unauthenticated_total", {"door": door})
        for door in ("config", "offer", "websocket")
    }
    assert all(count and count >= 1 for count in unauthenticated.values()), unauthenticated


async def test_a_session_resumes_only_for_its_owner_and_a_takeover_leaves_it_alone(gateway: GatewayServer) -> None:
    alice, bob = issue_token(KEYS, "alice", 60), issue_token(KEYS, "bob", 60)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = conversation_pb2_grpc.ConversationStub(channel)
        owner = stub.Converse(requests(config("alices-session"), hold=True), metadata=bearer(alice))
        started = (await anext(aiter(owner))).started
        session = gateway.servicer.active["alices-session"]
        for metadata, resume in ((bearer(bob), ""), (bearer(STATIC), ""), (bearer(bob), "guessed-token")):
            call = stub.Converse(requests(config("alices-session", resume), hold=True), metadata=metadata)
            await expect_error(call, grpc.StatusCode.PERMISSION_DENIED, "belongs to another caller")
        assert gateway.servicer.active["alices-session"] is session, "the owner's session was not disturbed"
        # The owner comes back by her token's subject; each start hands out a new resume token (the old one is void),
        # and anyone holding the newest one may resume: a page moving from WebRTC to WebSocket, a static-token client.
        again = await _converse(gateway, bearer(alice), config("alices-session"))
        assert isinstance(again, conversation_pb2.ConverseEvent) and again.started.session_id == "alices-session"
        stale = await _converse(gateway, bearer(STATIC), config("alices-session", started.resume_token))
        assert isinstance(stale, grpc.aio.AioRpcError) and stale.code() == grpc.StatusCode.PERMISSION_DENIED
        resumed = await _converse(gateway, bearer(STATIC), config("alices-session", again.started.resume_token))
        assert isinstance(resumed, conversation_pb2.ConverseEvent) and resumed.started.history_turns == 0
        owner.cancel()


async def test_bad_offers_leak_no_session_and_starts_are_rate_limited() -> None:
    server = await start_offline_gateway(auth_token=STATIC, session_starts_per_minute=60)  # bursts of 10
    try:
        headers = {"Authorization": f"Bearer {STATIC}"}
        statuses = []
        async with aiohttp.ClientSession() as client:
            for _ in range(12):
                offer = {"type": "offer", "sdp": "v=0\r\nnot an offer\r\n", "config": {}}
                async with client.post(
                    f"http://127.0.0.1:{server.http_port}/api/offer", json=offer, headers=headers
                ) as reply:
                    statuses.append(reply.status)
        assert statuses[:10] == [400] * 10  # a burst of 10 is let in; none leaves a session behind
        assert statuses[10:] == [429, 429]  # Too Many Requests: this client, not the gateway, is over its limit
        assert server.servicer.active == {}
    finally:
        await server.stop()


async def test_no_credential_reaches_the_logs(gateway: GatewayServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = issue_token(KEYS, "carol", 60)
    await _converse(gateway, bearer(secret + "x"), config())
    await _converse(gateway, bearer(secret), config())
    async with aiohttp.ClientSession() as client:
        ws = await client.ws_connect(f"http://127.0.0.1:{gateway.http_port}/api/ws")
        await ws.send_str(json.dumps({"type": "start", "token": STATIC + "x", "config": {}}))
        await ws.receive()
    logged = " ".join(f"{record.getMessage()} {record.__dict__}" for record in caplog.records)
    assert "unauthenticated" in logged  # the refusals are logged...
    for credential in (secret, STATIC, TURN_SECRET, KEYS.partition(":")[2]):
        assert credential not in logged  # ...without what was sent


# ---- a real turn over TLS ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def secure_services() -> Iterator[tuple[dict[str, str], LocalCertificates]]:
    """ASR, LLM and TTS that want mutual TLS and a token, as in a cluster without NetworkPolicy enforcement."""
    directory = Path(tempfile.mkdtemp(prefix="voicemesh-tls-"))
    certs = local_certificates(directory)
    mesh = Mesh(log_dir=str(directory / "logs"))
    health = {}
    for name in ("asr", "llm", "tts"):
        health[name] = free_port()
        flags = [
            f"--tls-cert={certs.server.cert_file}",
            f"--tls-key={certs.server.key_file}",
            f"--tls-client-ca={certs.ca_file}",
            f"--health-port={health[name]}",
            f"--auth-token={STATIC}",
        ]
        mesh.start(name, free_port(), flags)
    try:

        async def ready() -> None:
            await asyncio.gather(*(wait_healthy(f"127.0.0.1:{port}", 240) for port in health.values()))

        asyncio.run(ready())
        yield {name: process.target for name, process in mesh.processes.items()}, certs
    finally:
        mesh.stop_all()


async def test_a_real_turn_over_tls_to_the_gateway_and_mutual_tls_to_every_service(
    secure_services: tuple[dict[str, str], LocalCertificates],
) -> None:
    targets, certs = secure_services
    server = await start_gateway(
        targets["asr"],
        targets["llm"],
        targets["tts"],
        tls_cert=certs.server.cert_file,
        tls_key=certs.server.key_file,
        jwt_keys=KEYS,
        service_token=STATIC,
        service_tls_ca=certs.ca_file,
        service_tls_cert=certs.client.cert_file,
        service_tls_key=certs.client.key_file,
    )
    try:
        credentials = Credentials(ClientTls(certs.ca_file), issue_token(KEYS, "alice", 300))
        turns, _, events = await talk(
            f"localhost:{server.port}", load_clip("spk2_snt1"), trailing_silence_s=5.0, credentials=credentials
        )
        assert turns and turns[0].reply_text and turns[0].v2v_ms is not None, events
        assert any(isinstance(event, ReplyAudio) for event in events)
        # The browser door is HTTPS with the same certificate (and plain HTTP is not spoken there).
        context = ssl.create_default_context(cafile=certs.ca_file)
        headers = {"Authorization": f"Bearer {credentials.token}"}
        async with aiohttp.ClientSession() as client:
            url = f"https://localhost:{server.http_port}/api/config"
            async with client.get(url, headers=headers, ssl=context) as reply:
                assert reply.status == 200 and (await reply.json())["frame_ms"] == 20
            with pytest.raises(aiohttp.ClientError):
                async with client.get(f"http://localhost:{server.http_port}/api/config", headers=headers) as reply:
                    await reply.read()
    finally:
        await server.stop()


async def test_every_service_refuses_a_caller_with_the_certificate_but_without_the_token(
    secure_services: tuple[dict[str, str], LocalCertificates],
) -> None:
    targets, certs = secure_services
    for token, expected in (("", grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED)):
        credentials = Credentials(certs.client, token)
        calls = {
            "asr": clients.recognize(targets["asr"], load_clip("spk1_snt1"), realtime=False, credentials=credentials),
            "llm": clients.generate(targets["llm"], [(llm_pb2.ROLE_USER, "Hi")], credentials=credentials),
            "tts": clients.synthesize(targets["tts"], ["Hello."], credentials=credentials),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
            assert refused.value.code() == expected, (name, refused.value.details())
            assert refused.value.details() == "unauthenticated", name
