"""A session's measurements of its turns: the turn's span and its children, the per-turn metrics event, the stage
histograms and the turn's log line, from what the session did and what its client reports."""

from __future__ import annotations

import collections
import logging
import socket

from gateway.outbox import Outbox
from gateway.playout import Playout
from gateway.reply import Reply, ReplyFrame
from voicemesh import stages, telemetry
from voicemesh.clients import epoch_us
from voicemesh.v1 import asr_pb2, conversation_pb2

log = logging.getLogger(__name__)
TRACER = telemetry.tracer("gateway.session")  # the scope of every turn span a session makes
HOSTNAME = socket.gethostname()
RECEIPTS_KEPT = 500  # 10 s of frames: far more than an endpoint looks back
RECENT_TURNS_KEPT = 4  # ended turns a late client report may still be about


class TurnRecorder:
    """Measures one session's turns. The session calls it as it carries out the turn controller's commands."""

    def __init__(self, outbox: Outbox, transport: str, log_transcripts: bool) -> None:
        self.outbox = outbox
        self.transport = transport
        self.log_transcripts = log_transcripts  # what was said, in the turn's log line: personal data
        self.receipt_us: collections.OrderedDict[int, int] = collections.OrderedDict()  # capture us -> receipt us
        self.recent: dict[int, Reply] = {}  # ended turns, for client reports that come after the end
        self.discarded = 0  # speculative replies overtaken since the last commit

    def received(self, capture_us: int, now_us: int) -> None:
        """A frame captured at `capture_us` reached the gateway at `now_us` (the upload stage of its turn)."""
        self.receipt_us[capture_us] = now_us
        while len(self.receipt_us) > RECEIPTS_KEPT:
            self.receipt_us.popitem(last=False)

    def started(self, reply: Reply, event: asr_pb2.RecognizeEvent) -> None:
        """The reply's turn span starts: at the speech's end, or now for a reply started on a partial."""
        start_us = (event.speech_end_capture_time_us if reply.started == "pause" else 0) or epoch_us()
        reply.span = TRACER.start_span(
            "turn",
            start_time=start_us * 1000,
            attributes={
                "session.id": self.outbox.session_id,
                "transport": self.transport,
                "replica": HOSTNAME,
                "speculative": reply.speculative,
                "speculative.started": reply.started if reply.speculative else "",
                "audio_s": max(0, event.speech_end_ms - event.speech_start_ms) / 1000,
            },
        )

    def prefill_scored(self, reply: Reply) -> None:
        """The reply's words came with a prefill's turn-end score: the reply asks for none."""
        telemetry.TURN_END_SCORES.labels("prefill").inc()
        reply.metrics.turn_end_from_prefill = True
        if reply.span is not None:
            reply.span.set_attribute("turn_end.from_prefill", True)

    def committed(self, reply: Reply, event: asr_pb2.RecognizeEvent) -> None:
        """The user's turn committed with `event`: its upload, endpoint and ASR stages, and what was speculative."""
        committed_us = epoch_us()
        capture_us = event.speech_end_capture_time_us
        receipt_us = self.receipt_us.get(capture_us, committed_us)
        capture_us = capture_us or receipt_us
        metrics = reply.metrics
        metrics.speech_end_capture_us = capture_us
        metrics.upload_ms = (receipt_us - capture_us) / 1000
        metrics.endpoint_ms = (committed_us - receipt_us) / 1000
        metrics.asr_queue_ms, metrics.asr_compute_ms = event.timing.queue_ms, event.timing.compute_ms
        if event.WhichOneof("event") == "final":
            metrics.hangover_ms, metrics.completeness = event.final.hangover_ms, event.final.completeness
        metrics.turn_end_probability = -1.0 if reply.turn_end is None else reply.turn_end
        if (scored_us := reply.timeline.get("turn_scored")) is not None:
            metrics.turn_score_ms = max(0.1, (scored_us - receipt_us) / 1000)  # 0 means none came
        reply.committed_us, reply.receipt_us = committed_us, receipt_us
        if reply.speculative:
            telemetry.SPECULATIVE.labels("used", reply.started).inc()
        telemetry.TURNS.inc()
        metrics.speculative_used = reply.speculative
        metrics.started_on_partial = reply.started == "partial"
        metrics.speculative_discarded = self.discarded
        self.discarded = 0

    def discarded_reply(self, reply: Reply) -> None:
        """A speculative reply was overtaken: never spoken, never in history."""
        self.discarded += 1
        telemetry.SPECULATIVE.labels("discarded", reply.started).inc()
        if reply.span is not None:
            reply.span.set_attribute("speculative.discarded", True)
            reply.span.end()

    def interrupted(self, reply: Reply, spoken: str, dropped_frames: int, continued: bool) -> None:
        log.info(
            "barge-in",
            extra={
                "session_id": self.outbox.session_id,
                "spoken_chars": len(spoken),
                "dropped_frames": dropped_frames,
                "continued": continued,
            },
        )
        telemetry.INTERRUPTIONS.inc()
        if reply.span is not None:
            reply.span.set_attribute("interrupted", True)
            reply.span.set_attribute("turn.continued", continued)

    def playout_ends(self, reply: Reply, playout: Playout[ReplyFrame]) -> None:
        """The gaps the reply's listener heard, and how far ahead of it the reply's later audio came."""
        reply.metrics.reply_gap_ms = max(reply.metrics.reply_gap_ms, round(playout.gap_s * 1000, 1))
        if playout.ahead_min_s is not None:
            ahead_ms = round(playout.ahead_min_s * 1000, 1)
            if reply.metrics.HasField("reply_ahead_min_ms"):
                ahead_ms = min(ahead_ms, reply.metrics.reply_ahead_min_ms)
            reply.metrics.reply_ahead_min_ms = ahead_ms

    def ended(self, reply: Reply) -> None:
        """The turn is over: its metrics go to the client, the histograms and the log; its span ends."""
        metrics = reply.metrics
        metrics.prompt_tokens = reply.usage.prompt_tokens
        metrics.cached_prompt_tokens = reply.usage.cached_prompt_tokens
        metrics.completion_tokens = reply.usage.completion_tokens
        metrics.reply_audio_ms = reply.frames_sent * 20
        if reply.first_sent_us:
            metrics.first_audio_sent_us = reply.first_sent_us
            metrics.v2v_ms = (reply.first_sent_us - metrics.speech_end_capture_us) / 1000
            metrics.gateway_hold_ms = (reply.first_sent_us - reply.first_frame_received_us) / 1000
        self.outbox.emit(metrics=metrics, turn=reply.turn_index)
        self._record_turn(reply)
        origin = metrics.speech_end_capture_us
        spoken = (
            {"user_text": reply.user_text, "reply_text": " ".join(reply.spoken_chunks)} if self.log_transcripts else {}
        )
        log.info(
            "turn",
            extra={
                "session_id": self.outbox.session_id,
                "turn": reply.turn_index,
                "v2v_ms": round(metrics.v2v_ms, 1),
                "reply_gap_ms": metrics.reply_gap_ms,
                "reply_ahead_min_ms": metrics.reply_ahead_min_ms if metrics.HasField("reply_ahead_min_ms") else None,
                "timeline_ms": {k: round((v - origin) / 1000, 1) for k, v in reply.timeline.items()},
                **spoken,
            },
        )
        if reply.span is not None:
            reply.span.end()
        self.recent[reply.turn_index] = reply
        while len(self.recent) > RECENT_TURNS_KEPT:
            self.recent.pop(min(self.recent))

    def _record_turn(self, reply: Reply) -> None:
        """Stage histograms, and the turn's spans for what the gateway measured itself (the ASR stream spans
        many turns, so its decode is recorded here from the times the ASR service reported)."""
        metrics = reply.metrics
        for stage, value_ms in stages.server_stages_ms(metrics).items():
            telemetry.TURN_STAGE.labels(stage).observe(max(0.0, value_ms) / 1000)
        if metrics.v2v_ms:
            telemetry.TURN_V2V.observe(metrics.v2v_ms / 1000)
        span = reply.span
        if span is None:
            return
        span.set_attributes(
            {
                "turn.index": reply.turn_index,
                "v2v_ms": metrics.v2v_ms,
                "llm.replica": metrics.llm_replica,
                "prompt_tokens": metrics.prompt_tokens,
                "completion_tokens": metrics.completion_tokens,
                "speculative.used": metrics.speculative_used,
                "speculative.discarded_before": metrics.speculative_discarded,
            }
        )
        capture_ns, receipt_ns = metrics.speech_end_capture_us * 1000, reply.receipt_us * 1000
        telemetry.timed_span(TRACER, "upload", capture_ns, receipt_ns, span)
        telemetry.timed_span(TRACER, "endpoint", receipt_ns, reply.committed_us * 1000, span)
        event = reply.asr_event
        if event is not None and event.decode_done_us:
            done_ns = event.decode_done_us * 1000
            started_ns = done_ns - int(event.timing.compute_ms * 1e6)
            queued_ns = started_ns - int(event.timing.queue_ms * 1e6)
            attributes = {"service": "asr", "reconstructed": True}
            telemetry.timed_span(TRACER, "asr.queue", max(queued_ns, capture_ns), started_ns, span, attributes)
            telemetry.timed_span(TRACER, "asr.compute", max(started_ns, capture_ns), done_ns, span, attributes)
            if event.traceparent:
                telemetry.link_to(span, event.traceparent, {"stage": "asr"})

    def on_client_report(self, report: conversation_pb2.ClientReport, current: Reply | None) -> None:
        """The client says when a turn's first audio arrived (the downlink stage) and, if it measures them, the hops
        of its own path (`stages.CLIENT_HOPS`). A time out of order with the gateway's own is left out: the client's
        clock is not this one (another machine), or the report is not about this turn."""
        reply = current if current is not None and current.turn_index == report.turn_index else None
        reply = reply or self.recent.get(report.turn_index)
        if reply is None or not reply.first_sent_us:
            return
        received_us = report.first_audio_received_us
        if received_us >= reply.first_sent_us:
            reply.received_us = received_us
            self._hop("downlink", reply, reply.first_sent_us, received_us)
        if report.first_audio_played_us:
            self._hop("playout", reply, reply.received_us or reply.first_sent_us, report.first_audio_played_us)
        capture_us, sent_us = reply.metrics.speech_end_capture_us, report.speech_end_frame_sent_us
        if sent_us and capture_us <= sent_us <= reply.receipt_us:
            self._hop("capture_to_sent", reply, capture_us, sent_us)
            self._hop("sent_to_gateway", reply, sent_us, reply.receipt_us)

    def _hop(self, name: str, reply: Reply, start_us: int, end_us: int) -> None:
        if not start_us or end_us < start_us:
            return
        telemetry.TURN_STAGE.labels(name).observe((end_us - start_us) / 1e6)
        if reply.span is not None:
            telemetry.timed_span(TRACER, stages.span_of(name), start_us * 1000, end_us * 1000, reply.span)
