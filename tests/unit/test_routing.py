import collections

import grpc
import pytest

from gateway.backends import Backends
from voicemesh.admission import QueueAdmission, StreamLimit
from voicemesh.errors import RequestError
from voicemesh.mesh import free_port
from voicemesh.routing import ReplicaSet, parse_targets, rendezvous_rank
from voicemesh.v1 import llm_pb2, llm_pb2_grpc

REPLICAS = [f"10.0.0.{i}:50062" for i in range(1, 6)]
SESSIONS = [f"session-{i}" for i in range(2000)]


def test_ranking_is_stable_and_independent_of_replica_order() -> None:
    for session in SESSIONS[:50]:
        assert rendezvous_rank(session, REPLICAS) == rendezvous_rank(session, list(reversed(REPLICAS)))
        assert sorted(rendezvous_rank(session, REPLICAS)) == sorted(REPLICAS)


def test_sessions_spread_over_replicas() -> None:
    first = collections.Counter(rendezvous_rank(s, REPLICAS)[0] for s in SESSIONS)
    assert set(first) == set(REPLICAS)
    assert min(first.values()) > len(SESSIONS) / len(REPLICAS) * 0.7


def test_removing_a_replica_moves_only_its_sessions() -> None:
    before = {s: rendezvous_rank(s, REPLICAS)[0] for s in SESSIONS}
    gone = REPLICAS[2]
    remaining = [r for r in REPLICAS if r != gone]
    after = {s: rendezvous_rank(s, remaining)[0] for s in SESSIONS}
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == gone}
    # ...and each moved session lands on its own second choice.
    assert all(after[s] == rendezvous_rank(s, REPLICAS)[1] for s in moved)


def test_adding_a_replica_takes_sessions_only_onto_itself() -> None:
    before = {s: rendezvous_rank(s, REPLICAS[:4])[0] for s in SESSIONS}
    after = {s: rendezvous_rank(s, REPLICAS)[0] for s in SESSIONS}
    assert all(after[s] in (before[s], REPLICAS[4]) for s in SESSIONS)


def test_target_specs() -> None:
    assert parse_targets("a:1, b:2") == (["a:1", "b:2"], None)
    assert parse_targets("dns:///voicemesh-llm-headless:50062") == ([], "voicemesh-llm-headless:50062")
    with pytest.raises(ValueError):
        parse_targets(" , ")


def test_unhealthy_replicas_are_skipped_unless_all_are_down() -> None:
    replicas = ReplicaSet("a:1,b:2,c:3")
    replicas.replicas["b:2"].healthy = False
    assert "b:2" not in replicas.sticky_order("s")
    replicas.replicas["b:2"].in_flight = 0
    replicas.replicas["a:1"].in_flight = 3
    assert replicas.least_loaded_order() == ["c:3", "a:1"]
    for load in replicas.replicas.values():
        load.healthy = False
    assert sorted(replicas.sticky_order("s")) == ["a:1", "b:2", "c:3"]


def test_queue_admission_refuses_past_the_budget() -> None:
    admission = QueueAdmission(slots=1, budget_ms=500, replica="r1")
    with admission.admit(), admission.admit():  # unknown service time: admitted
        pass
    admission.record(400.0)
    with admission.admit():  # a free slot: no wait
        with admission.admit():  # behind the busy one: ~0.5 * 400 = 200 ms
            pass
    with admission.admit(), admission.admit(), pytest.raises(RequestError) as refused:
        with admission.admit():  # one more ahead: ~(1 + 0.5) * 400 = 600 ms > 500
            pass
    assert refused.value.code.name == "RESOURCE_EXHAUSTED" and "budget 500 ms" in refused.value.message
    assert admission.in_flight == 0


def test_queue_admission_zero_budget_is_off_and_stream_limit() -> None:
    admission = QueueAdmission(slots=1, budget_ms=0, replica="r1")
    admission.record(10_000)
    with admission.admit(), admission.admit(), admission.admit():
        pass
    limit = StreamLimit(1, "r1")
    with limit.hold(), pytest.raises(RequestError):
        with limit.hold():
            pass
    assert limit.open == 0


class FakeGenerator(llm_pb2_grpc.GeneratorServicer):
    """An LLM replica that answers every request with one word."""

    async def Generate(self, request, context):
        yield llm_pb2.GenerateResponse(text_delta="hello", replica="alive")


async def test_a_replica_left_out_as_suspect_is_tried_once_the_healthy_ones_fail() -> None:
    """A busy replica that missed a health check is out of the ranking; when the replica that is in dies, the turn
    still goes to the suspect one rather than failing with UNAVAILABLE (seen in the routing integration test)."""
    server = grpc.aio.server()
    llm_pb2_grpc.add_GeneratorServicer_to_server(FakeGenerator(), server)
    alive = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: the connection is refused
    backends = Backends(dead, f"{dead},{alive}", dead)
    try:
        backends.mark_down("llm", alive)
        assert backends.llm_order("s") == [dead]
        request = llm_pb2.GenerateRequest(
            session_id="s", messages=[llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content="hi")]
        )
        replies = [r async for r in backends.generate(request)]
        assert [r.replica for r in replies] == ["alive"]
    finally:
        await backends.close()
        await server.stop(None)


class FakePrefilllessGenerator(llm_pb2_grpc.GeneratorServicer):
    """An LLM replica whose engine never prefills (an older one, or an engine without a cache of its own)."""

    def __init__(self) -> None:
        self.prefills = 0

    async def Prefill(self, request, context):
        self.prefills += 1
        return llm_pb2.PrefillResponse(skipped=True, unsupported=True, replica="old")


async def test_a_gateway_stops_sending_prefills_to_a_replica_that_never_prefills() -> None:
    fake = FakePrefilllessGenerator()
    server = grpc.aio.server()
    llm_pb2_grpc.add_GeneratorServicer_to_server(fake, server)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    backends = Backends(target, target, target)
    request = llm_pb2.PrefillRequest(
        session_id="s", messages=[llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content="Hi")]
    )
    try:
        first = await backends.prefill(request)
        assert first is not None and first.unsupported
        assert await backends.prefill(request) is None, "learnt: no second call"
        assert fake.prefills == 1
    finally:
        await backends.close()
        await server.stop(None)
