"""The real programs an operator runs, on one local mesh with auth on: Debian's Prometheus scrapes every process with
its token and evaluates the chart's rules (every recording rule and every dashboard query returns data after a few
spoken turns; a scrape without the token is a down target with a 401), and a real OpenTelemetry collector (rotel)
receives a turn's trace over OTLP/gRPC from all four processes (the ASR's decode in a trace of its own, which the
turn's span links to), forwarding it to a receiver the test reads."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.conftest import free_port, load_clip
from voicemesh import observe, report
from voicemesh.clients import Credentials
from voicemesh.conversation import talk
from voicemesh.mesh import DEFAULT_PORTS, Mesh
from voicemesh.stages import SPAN_NAMES
from voicemesh.telemetry import LATENCY_BUCKETS_S

pytestmark = pytest.mark.integration

SERVICE_TOKEN = "monitoring-test-service-token-0123456789"
CLIENT_TOKEN = "monitoring-test-client-token-0123456789"
CLIPS = ("spk2_snt1", "spk1_snt1")


@dataclass
class Observed:
    prometheus: str
    """Base URL of the Prometheus."""
    spans: list[dict[str, Any]]
    """What the collector forwarded."""
    v2v_ms: list[float]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def observed() -> AsyncIterator[Observed]:
    """One mesh (auth on, metrics on every process, spans to the collector), Prometheus scraping it, a few turns."""
    if observe.prometheus_binary() is None:
        pytest.skip("Debian's prometheus is not installed (make test installs it when root: make prometheus)")
    if observe.collector_binary() is None:
        pytest.skip("the rotel collector is not installed (pip install -e '.[local,dev]' brings it)")
    directory = Path(tempfile.mkdtemp(prefix="voicemesh-monitoring-"))
    receiver, receiver_port, forwarded = await report.start_collector()
    ports = {name: free_port() for name in DEFAULT_PORTS}
    metrics = {name: free_port() for name in DEFAULT_PORTS}
    otlp_port, prometheus_port = free_port(), free_port()
    processes: dict[str, subprocess.Popen[bytes]] = {}
    mesh = Mesh(log_dir=str(directory))
    try:
        processes["collector"] = observe.start_collector(
            directory, otlp_port, free_port(), forward_to=f"http://127.0.0.1:{receiver_port}"
        )
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}", "OTEL_BSP_SCHEDULE_DELAY": "200"}
        mesh.start_local(
            ports, -1, [f"--auth-token={CLIENT_TOKEN}"], service_token=SERVICE_TOKEN, metrics_ports=metrics, env=env
        )
        targets = [
            observe.Target(name, f"127.0.0.1:{metrics[name]}", CLIENT_TOKEN if name == "gateway" else SERVICE_TOKEN)
            for name in DEFAULT_PORTS
        ]
        config = observe.prometheus_config(targets, directory, unauthenticated=f"127.0.0.1:{metrics['gateway']}")
        processes["prometheus"] = observe.start_prometheus(config, directory, prometheus_port)
        base = f"http://127.0.0.1:{prometheus_port}"
        await mesh.wait(timeout_s=240)
        await asyncio.to_thread(observe.wait_ready, base, processes["prometheus"])
        v2v = []
        for clip in CLIPS:
            turns, _, _ = await talk(
                f"127.0.0.1:{ports['gateway']}",
                load_clip(clip),
                trailing_silence_s=2.5,
                credentials=Credentials(token=CLIENT_TOKEN),
            )
            assert len(turns) == 1 and turns[0].v2v_ms, f"{clip}: {turns}"
            v2v.append(turns[0].v2v_ms)
        yield Observed(base, forwarded.spans, v2v)
    finally:
        mesh.stop_all()
        observe.stop(processes)
        await receiver.stop(0)
        shutil.rmtree(directory / "data", ignore_errors=True)  # Prometheus's TSDB; the logs stay for a failure


async def _until(what: str, probe: Callable[[], list[str]], timeout_s: float = 60.0) -> None:
    """Poll `probe` (what is still missing) until it returns nothing; fail naming what is missing."""
    deadline = time.monotonic() + timeout_s
    while (missing := await asyncio.to_thread(probe)) and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
    assert not missing, f"{what}: {missing}"


async def test_every_recording_rule_and_dashboard_query_returns_data(observed: Observed) -> None:
    rules = observe.recording_rules()
    queries = observe.dashboard_queries()
    assert len(rules) >= 20 and len(queries) >= 15

    def empty() -> list[str]:
        return [q for q in [*rules, *(item["expr"] for item in queries)] if not observe.query(observed.prometheus, q)]

    await _until("no data from Prometheus for", empty)
    # The numbers are the mesh's: V2V p99 over these turns lies in the bucket of the slowest (one bucket of slack:
    # the client's V2V adds the downlink to the gateway's).
    p99 = float(observe.query(observed.prometheus, "voicemesh:turn_v2v_seconds:p99_rate5m")[0]["value"][1])
    buckets = (0.0, *LATENCY_BUCKETS_S)
    slowest = next(i for i, bound in enumerate(buckets) if bound >= max(observed.v2v_ms) / 1000)
    assert buckets[max(0, slowest - 2)] <= p99 <= buckets[min(slowest + 1, len(buckets) - 1)], (p99, observed.v2v_ms)
    turns = observe.query(observed.prometheus, "sum(voicemesh_turns_total)")
    assert float(turns[0]["value"][1]) >= len(CLIPS)
    serving = observe.query(observed.prometheus, "voicemesh:serving_replicas:sum")
    assert {s["metric"]["component"]: s["value"][1] for s in serving} == dict.fromkeys(DEFAULT_PORTS, "1")


def test_a_scrape_without_the_token_is_a_down_target_with_a_401(observed: Observed) -> None:
    by_job = {t["labels"]["job"]: t for t in observe.targets(observed.prometheus)}
    wrong = by_job[observe.UNAUTHENTICATED_JOB]
    assert wrong["health"] == "down" and "401" in wrong["lastError"], wrong
    for name in DEFAULT_PORTS:
        assert by_job[f"voicemesh-{name}"]["health"] == "up", by_job[f"voicemesh-{name}"]
    up = observe.query(observed.prometheus, f'up{{job="{observe.UNAUTHENTICATED_JOB}"}}')
    assert up[0]["value"][1] == "0"
    # The alert sees the component labels the real scrapes carry; the unlabelled wrong job is not a stage.
    assert not observe.query(observed.prometheus, 'ALERTS{alertname="VoicemeshNoHealthyReplica"}')


async def test_the_collector_receives_a_turn_trace_across_processes(observed: Observed) -> None:
    def incomplete() -> list[str]:
        traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for span in observed.spans:
            traces[span["trace_id"]].append(span)
        wanted = {"turn", *SPAN_NAMES, "linked asr.decode"}
        best = max(traces.values(), key=lambda t: len(_names(t, observed.spans) & wanted), default=[])
        return sorted(wanted - _names(best, observed.spans))

    await _until("the collector forwarded no trace with these spans", incomplete)
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in observed.spans:
        traces[span["trace_id"]].append(span)
    trace = next(t for t in traces.values() if {"turn", *SPAN_NAMES, "linked asr.decode"} <= _names(t, observed.spans))
    spans = {s["name"]: s for s in trace}
    turn = spans["turn"]
    decode = next(s for s in observed.spans if s["span_id"] in {link["span_id"] for link in turn["links"]})
    assert decode["trace_id"] != turn["trace_id"] and decode["parent_id"] is None
    assert decode["attributes"]["session.id"] == turn["attributes"]["session.id"]
    assert {s["service"] for s in [*trace, decode]} == {f"voicemesh-{n}" for n in ("gateway", "asr", "llm", "tts")}
    assert turn["parent_id"] is None
    by_id = {s["span_id"]: s for s in trace}
    for span in trace:  # every span's parent link resolves inside the trace, across the process boundaries
        assert span["parent_id"] is None or span["parent_id"] in by_id, span["name"]
    assert spans["llm.generate"]["parent_id"] == turn["span_id"]
    assert spans["tts.synthesize"]["parent_id"] == turn["span_id"]
    assert spans["llm.first_token"]["parent_id"] == spans["llm.generate"]["span_id"]


def _names(trace: list[dict[str, Any]], spans: list[dict[str, Any]]) -> set[str]:
    """The trace's span names, and "linked NAME" for each span elsewhere that one of its spans links to."""
    linked = {link["span_id"] for span in trace for link in span.get("links", [])}
    return {s["name"] for s in trace} | {f"linked {s['name']}" for s in spans if s["span_id"] in linked}
