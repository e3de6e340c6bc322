"""Tracing and metrics for every process.

Traces: OpenTelemetry spans, exported over OTLP/gRPC when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`..._TRACES_ENDPOINT`) is set — the SDK reads every other `OTEL_*` variable itself — and/or to a JSONL file
(`trace_file` setting). Nothing is exported otherwise. W3C trace context crosses calls in gRPC metadata, and
in-band (`traceparent` fields) on streams that outlive a turn.
Metrics: Prometheus histograms and counters, scraped from `metrics_port` (0 = no endpoint).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

log = logging.getLogger(__name__)

_provider: TracerProvider | None = None

# Buckets from 5 ms to 10 s: voice latency lives between 50 ms and a few seconds.
LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
)

TURN_V2V = Histogram("voicemesh_turn_v2v_seconds", "Voice-to-voice per turn (gateway view)", buckets=LATENCY_BUCKETS_S)
TURN_STAGE = Histogram(
    "voicemesh_turn_stage_seconds",
    "Each stage of a turn (queue and compute apart)",
    ["stage"],
    buckets=LATENCY_BUCKETS_S,
)
SESSIONS = Counter("voicemesh_sessions_total", "Conversation sessions started", ["transport"])
ACTIVE_SESSIONS = Gauge("voicemesh_gateway_active_sessions", "Sessions open on this gateway")
TURNS = Counter("voicemesh_turns_total", "User turns committed")
INTERRUPTIONS = Counter("voicemesh_interruptions_total", "Replies cut short by barge-in")
CANCELLATIONS = Counter("voicemesh_cancellations_total", "LLM/TTS work cancelled (barge-in, superseded, failed)")
OVERLAPS = Counter(
    "voicemesh_overlaps_resumed_total",
    "User speech over a reply that did not interrupt it, by kind (backchannel, false_interruption)",
    ["reason"],
)
TURN_SCORES = Counter(
    "voicemesh_turn_scores_total",
    "End-of-turn completeness scores by outcome (in_time, late: the fixed hangover had applied, failed)",
    ["outcome"],
)
TURN_SCORES_VETOED = Counter(
    "voicemesh_turn_scores_vetoed_total",
    "Language-model turn-end scores the ASR overruled with the long wait, by why it doubted the transcript "
    "(ends_in_filler, fillers_only, low_confidence, one_unsure_word, no_words)",
    ["reason"],
)
TURN_END_SCORES = Counter(
    "voicemesh_turn_end_scores_total",
    "The LLM's turn-end scores the gateway handed to the ASR, by source (prefill: a partial with the endpoint "
    "candidate's words was prefilled and scored, so the pause did not wait for the reply's; reply: the speculative "
    "reply's own)",
    ["source"],
)
PREFILLS = Counter(
    "voicemesh_llm_prefills_total",
    "Prefills of a partial transcript by outcome (evaluated; nothing_new: all cached; skipped: the replica was serving "
    "a reply, or its engine needs none; failed: the gateway's call failed, the reply prefills it all)",
    ["outcome"],
)
SPECULATIVE = Counter(
    "voicemesh_speculative_starts_total",
    "Speculative reply starts by outcome (used, discarded) and by what started them (pause: the endpoint candidate; "
    "partial: a partial transcript the LLM scored a finished turn, before the speech stopped)",
    ["outcome", "started"],
)
ERRORS = Counter("voicemesh_errors_total", "Errors by stage and gRPC status", ["stage", "code"])
QUEUE_WAIT = Histogram(
    "voicemesh_queue_wait_seconds", "Time work waited for a worker or slot", ["service"], buckets=LATENCY_BUCKETS_S
)
COMPUTE = Histogram(
    "voicemesh_compute_seconds", "Time to the first result on a worker", ["service"], buckets=LATENCY_BUCKETS_S
)
TAKEOVERS_REFUSED = Counter(
    "voicemesh_session_takeovers_refused_total", "Session resumes refused: the caller did not own the session", ["door"]
)
UNAUTHENTICATED = Counter(
    "voicemesh_unauthenticated_total", "Requests refused for a missing or invalid credential", ["door"]
)
FAILOVERS = Counter(
    "voicemesh_failovers_total",
    "Work moved off a failed, hung or draining replica, by stage (asr: the utterance replayed; llm: the reply "
    "continued; tts: the unspoken rest synthesized again)",
    ["stage"],
)
for _stage in ("asr", "llm", "tts"):  # a zero rate, not no data, until the first failover
    FAILOVERS.labels(_stage)
REPLAYED_FRAMES = Counter("voicemesh_asr_replayed_frames_total", "Audio frames replayed to a new ASR stream")
WAITING = Gauge("voicemesh_waiting_requests", "Requests waiting for a worker or slot now", ["service"])
SERVING = Gauge("voicemesh_serving", "1 while this process's health check says SERVING (model loaded, not draining)")
CALLS = Counter("voicemesh_calls_total", "gRPC calls handled, by method (the denominator of error ratios)", ["method"])
RUNNING = Gauge("voicemesh_running_requests", "Requests holding a slot now (an LLM batch's sequences)", ["service"])
SLOTS = Gauge("voicemesh_slots", "Requests a replica serves at once (the LLM's batch size)", ["service"])
COMPLETION_TOKENS = Counter("voicemesh_llm_completion_tokens_total", "Tokens generated in finished replies")
WORKER_BUSY = Counter(
    "voicemesh_worker_busy_seconds_total", "Seconds worker threads spent in engine calls, by pool", ["pool"]
)
WORKERS = Gauge("voicemesh_workers", "Worker threads of a pool", ["pool"])
AUDIO = Counter(
    "voicemesh_audio_seconds_total",
    "Audio handled, by service (asr: heard; tts: synthesized): with worker busy seconds, the real-time factor",
    ["service"],
)
CERTIFICATE_EXPIRY = Gauge(
    "voicemesh_tls_certificate_expiry_timestamp_seconds",
    "When the TLS certificate this process loaded expires (epoch seconds), by role (server, client)",
    ["role"],
)


class JsonlSpanExporter(SpanExporter):
    """One JSON object per finished span, appended to a file (`voicemesh report` reads it)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_record(span)) for span in spans]
        with self._lock, open(self._path, "a", encoding="utf-8") as file:
            file.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS


def span_record(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    if context is None:  # the SDK gives every span it exports a context
        raise ValueError(f"span {span.name!r} has no context")
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "service": span.resource.attributes.get("service.name", ""),
        "attributes": dict(span.attributes or {}),
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ],
    }


def setup(
    service: str,
    replica: str = "",
    trace_file: str = "",
    metrics_port: int = 0,
    host: str = "127.0.0.1",
    metrics_authorized: Callable[[str], bool] | None = None,
) -> None:
    """Configure this process once: span export (OTLP by OTEL_* env, and/or a JSONL file) and /metrics."""
    global _provider
    replica = replica or socket.gethostname()
    resource = Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME", f"voicemesh-{service}"), "service.instance.id": replica}
    )
    provider = TracerProvider(resource=resource)
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if otlp and os.environ.get("OTEL_TRACES_EXPORTER", "otlp") != "none":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("exporting traces over OTLP", extra={"endpoint": otlp})
    if trace_file:
        provider.add_span_processor(BatchSpanProcessor(JsonlSpanExporter(trace_file)))
        log.info("writing traces", extra={"file": trace_file})
    trace.set_tracer_provider(provider)
    _provider = provider
    if metrics_port:
        serve_metrics(metrics_port, host, metrics_authorized)
        log.info("metrics endpoint", extra={"address": f"http://{host}:{metrics_port}/metrics"})


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # every scrape would be a stderr line
        pass


def serve_metrics(port: int, host: str, authorized: Callable[[str], bool] | None = None) -> int:
    """Prometheus /metrics on a thread; with `authorized`, a scrape without a valid bearer token gets a bare 401.

    Returns the port (for port 0)."""
    metrics_app = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if authorized is not None and not authorized(environ.get("HTTP_AUTHORIZATION", "")):
            UNAUTHENTICATED.labels("metrics").inc()
            start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Length", "0")])
            return [b""]
        body: Iterable[bytes] = metrics_app(environ, start_response)
        return body

    server = make_server(host, port, app, _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return int(server.server_port)


def shutdown() -> None:
    """Flush spans still in the batch processors (call on the way out)."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def metadata_for(span_context: trace.Span | None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the W3C trace context of `span_context` (empty if none)."""
    if span_context is None:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span_context))
    return list(carrier.items())


def traceparent_of(span: trace.Span | None) -> str:
    return dict(metadata_for(span)).get("traceparent", "")


def link_to(span: trace.Span, traceparent: str, attributes: dict[str, Any] | None = None) -> None:
    """Link `span` to the span a W3C `traceparent` names (work of another trace, e.g. the ASR's decode)."""
    linked = trace.get_current_span(context_from({"traceparent": traceparent})).get_span_context()
    if linked.is_valid:
        span.add_link(linked, attributes)


def context_from(carrier: Mapping[str, str] | Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The remote parent context from gRPC metadata pairs or a {"traceparent": ...} dict."""
    items = carrier.items() if isinstance(carrier, Mapping) else (carrier or ())
    return propagate.extract({key.lower(): value for key, value in items if isinstance(value, str)})


def timed_span(
    tracer_: trace.Tracer,
    name: str,
    start_ns: int,
    end_ns: int,
    parent: otel_context.Context | trace.Span,
    attributes: dict[str, Any] | None = None,
) -> None:
    """Record a span whose times are already known (measured before the span could be made)."""
    ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    span = tracer_.start_span(name, context=ctx, start_time=start_ns, attributes=attributes or {})
    span.end(end_time=max(end_ns, start_ns))
