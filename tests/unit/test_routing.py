import collections

import pytest

from voicemesh.admission import QueueAdmission, StreamLimit
from voicemesh.errors import RequestError
from voicemesh.routing import ReplicaSet, parse_targets, rendezvous_rank

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
