"""The stages of a turn, named once: the keys of reports and Prometheus labels, the trace span names and the
`TurnMetrics` fields (`<name>_ms`) all come from here."""

from __future__ import annotations

from dataclasses import dataclass

from voicemesh.v1 import conversation_pb2


@dataclass(frozen=True)
class Stage:
    """One stage of the path from the end of the user's speech to the first reply audio."""

    name: str
    """Key in reports and the `stage` label of `voicemesh_turn_stage_seconds`; `TurnMetrics` has `<name>_ms`."""
    span: str | None
    """Name of its trace span, or None where no process records one."""
    queue: bool
    """Time spent waiting rather than working: what grows first when a service runs out of capacity."""


STAGES = (
    Stage("upload", "upload", queue=False),
    Stage("endpoint", "endpoint", queue=False),
    Stage("asr_queue", "asr.queue", queue=True),
    Stage("asr_compute", "asr.compute", queue=False),
    Stage("llm_queue", "llm.queue", queue=True),
    Stage("llm_first_token", "llm.first_token", queue=False),
    Stage("tts_queue", "tts.queue", queue=True),
    Stage("tts_first_audio", "tts.first_audio", queue=False),
    Stage("gateway_hold", None, queue=True),
    Stage("downlink", "downlink", queue=False),
)
CLIENT_HOPS = (
    Stage("capture_to_sent", "client.capture_to_sent", queue=False),
    Stage("sent_to_gateway", "client.sent_to_gateway", queue=False),
    Stage("playout", "client.playout", queue=False),
)
"""Hops a client may report besides the downlink (`ClientReport`; the browser page does): they split the upload
stage (capture -> sent -> the gateway's receipt) and add the client's jitter buffer and audio output (received ->
audible). Histogram labels and span names like STAGES', kept apart because a gRPC client measures none of them."""
STAGE_NAMES = tuple(stage.name for stage in STAGES)
SPAN_NAMES = tuple(stage.span for stage in STAGES if stage.span is not None)
QUEUE_STAGES = tuple(stage.name for stage in STAGES if stage.queue)
SERVER_STAGES = tuple(name for name in STAGE_NAMES if name != "downlink")
"""The stages the gateway measures and sends in `TurnMetrics`; the client measures the downlink itself."""


def server_stages_ms(metrics: conversation_pb2.TurnMetrics) -> dict[str, float]:
    """The gateway's stage times of one turn, by stage name."""
    return {name: float(getattr(metrics, f"{name}_ms")) for name in SERVER_STAGES}


def span_of(name: str) -> str:
    """The trace span name of a stage or client hop, by its name."""
    return next(stage.span or stage.name for stage in (*STAGES, *CLIENT_HOPS) if stage.name == name)
