"""`voicemesh report`: percentiles of V2V and of every stage of a turn, from spans.

Spans come from a JSONL file written by the `trace_file` setting, or from an OTLP/gRPC receiver this command
runs for a while (point the services' OTEL_EXPORTER_OTLP_ENDPOINT at it). Queue time is reported apart from
compute time, because when p99 breaks, queueing is where to look first.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from voicemesh.loadstats import Summary, summarize
from voicemesh.stages import SPAN_NAMES


def read_jsonl(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    spans = []
    for path in paths:
        with open(path, encoding="utf-8") as file:
            spans += [json.loads(line) for line in file if line.strip()]
    return spans


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def records_from_otlp(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """OTLP spans -> the same records the JSONL exporter writes."""
    records = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                records.append(
                    {
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_id": span.parent_span_id.hex() or None,
                        "start_ns": span.start_time_unix_nano,
                        "end_ns": span.end_time_unix_nano,
                        "service": resource.get("service.name", ""),
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                        "links": [
                            {"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()} for link in span.links
                        ],
                    }
                )
    return records


class SpanCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver that keeps what it receives in memory."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()

    async def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext[
            trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse
        ],
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.spans += records_from_otlp(request)
        self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()


# The generated gRPC module has no annotations; this is the signature it has.
_add_servicer: Callable[[SpanCollector, grpc.aio.Server], None] = (
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server
)


async def start_collector(address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int, SpanCollector]:
    collector = SpanCollector()
    server = grpc.aio.server()
    _add_servicer(collector, server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, port, collector


def turn_table(spans: list[dict[str, Any]]) -> list[dict[str, float]]:
    """One row per answered turn: V2V and each stage's duration in ms (stages missing from a trace are absent)."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    rows = []
    for trace_spans in by_trace.values():
        turns = [s for s in trace_spans if s["name"] == "turn" and not s["attributes"].get("speculative.discarded")]
        if not turns or not turns[0]["attributes"].get("v2v_ms"):
            continue
        row = {"v2v": float(turns[0]["attributes"]["v2v_ms"])}
        for span in trace_spans:
            if span["name"] in SPAN_NAMES:
                row[span["name"]] = (span["end_ns"] - span["start_ns"]) / 1e6
        rows.append(row)
    return rows


@dataclass(frozen=True)
class SpanReport:
    """What `voicemesh report` prints: V2V and each span's duration over the answered turns."""

    turns: int
    v2v_ms: Summary
    stages_ms: dict[str, Summary]
    """By span name (`SPAN_NAMES`)."""

    def to_json(self) -> dict[str, object]:
        return {
            "turns": self.turns,
            "v2v_ms": self.v2v_ms.to_json(),
            "stages_ms": {name: summary.to_json() for name, summary in self.stages_ms.items()},
        }


def summarize_turns(spans: list[dict[str, Any]]) -> SpanReport:
    rows = turn_table(spans)
    return SpanReport(
        turns=len(rows),
        v2v_ms=summarize([r["v2v"] for r in rows]),
        stages_ms={stage: summarize([r[stage] for r in rows if stage in r]) for stage in SPAN_NAMES},
    )


def format_table(report: SpanReport) -> str:
    lines = [f"{report.turns} turns", f"{'stage':<18}{'count':>7}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}  (ms)"]
    for name, stats in [("v2v", report.v2v_ms), *report.stages_ms.items()]:
        values = (stats.p50, stats.p95, stats.p99, stats.max)
        cells = [f"{value:>9.1f}" if value is not None else f"{'-':>9}" for value in values]
        lines.append(f"{name:<18}{stats.count:>7}{''.join(cells)}")
    return "\n".join(lines)


async def collect(listen: str, seconds: float) -> list[dict[str, Any]]:
    server, port, collector = await start_collector(listen)
    print(f"receiving OTLP/gRPC spans on {listen.rsplit(':', 1)[0]}:{port} for {seconds:.0f} s", flush=True)
    try:
        await asyncio.sleep(seconds)
    finally:
        await server.stop(1)
    return collector.spans
