"""Two real llama.cpp LLM replicas behind the gateway's routing: stickiness, admission, failover."""

from __future__ import annotations

import asyncio

import pytest

from gateway.backends import Backends
from tests.conftest import free_port
from voicemesh.mesh import Mesh
from voicemesh.v1 import llm_pb2

pytestmark = pytest.mark.integration


def request(session_id: str, text: str = "Name one color.", max_tokens: int = 24) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        session_id=session_id,
        messages=[llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content=text)],
        max_tokens=max_tokens,
    )


async def served_by(backends: Backends, req: llm_pb2.GenerateRequest) -> str:
    replica = ""
    async for response in backends.generate(req):
        replica = replica or response.replica
    return replica


async def test_sticky_sessions_admission_and_failover(services: dict[str, str]) -> None:
    mesh = Mesh()
    # Replica A: one slot and a budget so small that anyone who would queue is refused at once.
    a = mesh.start("llm-a", free_port(), ["--replica", "llm-a", "--max-batch", "1", "--max-queue-wait-ms", "1"])
    b = mesh.start("llm-b", free_port(), ["--replica", "llm-b"])
    try:
        await mesh.wait()
        spec = f"{a.target},{b.target}"
        gateway_one = Backends(services["asr"], spec, services["tts"], health_interval_s=0.5)
        gateway_two = Backends(services["asr"], f"{b.target},{a.target}", services["tts"])  # another replica / restart
        await gateway_one.start()
        names = {a.target: "llm-a", b.target: "llm-b"}
        sessions = [f"session-{i}" for i in range(40)]
        assert all(gateway_one.llm_order(s) == gateway_two.llm_order(s) for s in sessions)
        on_a = [s for s in sessions if gateway_one.llm_order(s)[0] == a.target]
        on_b = [s for s in sessions if gateway_one.llm_order(s)[0] == b.target]
        assert on_a and on_b

        # Sticky: every turn of a session lands on its first choice.
        for session in (on_a[0], on_b[0]):
            for _ in range(2):
                assert await served_by(gateway_one, request(session)) == names[gateway_one.llm_order(session)[0]]

        # Admission: a burst on A (it has measured its service time above). The overflow is refused at once
        # with RESOURCE_EXHAUSTED and the gateway retries on B, so every call succeeds.
        burst = await asyncio.gather(*(served_by(gateway_one, request(s, max_tokens=32)) for s in on_a[:4]))
        assert all(burst)
        assert "llm-a" in burst and "llm-b" in burst

        # Failover: B dies; its sessions move to A (their second choice), A's sessions stay put.
        mesh.kill("llm-b")
        assert await served_by(gateway_one, request(on_b[1])) == "llm-a"
        assert await served_by(gateway_one, request(on_a[1])) == "llm-a"
        # Full everywhere (B dead, A's one slot taken, its budget 1 ms): the overflow waits for A's slot and is
        # served, instead of failing with RESOURCE_EXHAUSTED.
        crowd = await asyncio.gather(*(served_by(gateway_one, request(s, max_tokens=16)) for s in on_a[1:4]))
        assert crowd == ["llm-a"] * 3
        await gateway_one.close()
        await gateway_two.close()
    finally:
        mesh.stop_all()
