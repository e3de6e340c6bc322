"""What a load test or sweep reports, as typed records: their JSON (keys kept stable for users' tooling), the
files they are written to and the tables a person reads in a terminal."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from voicemesh.loadstats import PERCENTILE_METHOD, Summary, summarize
from voicemesh.loadtest.clips import SpeechClip
from voicemesh.loadtest.options import LoadTestOptions
from voicemesh.stages import QUEUE_STAGES, STAGE_NAMES

OK = "OK"
NOT_STARTED = "NOT_STARTED"


@dataclass(frozen=True)
class ReportFiles:
    """Where a report is written."""

    json: str
    html: str

    @classmethod
    def under(cls, out_dir: str | Path, stem: str) -> ReportFiles:
        """STEM.json and STEM.html in `out_dir`."""
        return cls(json=str(Path(out_dir) / f"{stem}.json"), html=str(Path(out_dir) / f"{stem}.html"))

    def write(self, data: dict[str, object], html: str) -> None:
        """Write the JSON and the HTML page, creating their directory."""
        Path(self.json).parent.mkdir(parents=True, exist_ok=True)
        Path(self.html).write_text(html, encoding="utf-8")
        Path(self.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class Machine:
    """The machine the load test ran on."""

    host: str
    cpus: int | None
    python: str

    @classmethod
    def here(cls) -> Machine:
        return cls(host=platform.node(), cpus=os.cpu_count(), python=platform.python_version())


@dataclass(frozen=True)
class ClipSummary:
    name: str
    speech_s: float
    """Length of the clip as sent (speech plus 100 ms)."""


@dataclass(frozen=True)
class TurnCounts:
    planned: int
    ok: int
    failed: int
    """Turns that started and did not finish OK."""
    not_started: int
    failed_by_error: dict[str, int]
    """Failed turns by status (a gRPC status name, the session error's `stage:code`, TIMEOUT, ...), most first."""


@dataclass(frozen=True)
class Throughput:
    ok_turns_per_min: float
    sessions_completed: int
    """Sessions all of whose turns finished OK."""


@dataclass(frozen=True)
class SessionRow:
    """One session of a load test; times in seconds since the test started."""

    session: int
    session_id: str
    started_s: float | None
    ended_s: float | None
    error: str
    """The first failure that ended the call, `STATUS: details`; empty when none did."""


@dataclass(frozen=True)
class TurnRow:
    """One turn of one session: what was measured, or why it failed; times in seconds since the test started."""

    session: int
    turn: int
    clip: str
    status: str
    """OK, NOT_STARTED, or why the turn failed."""
    ok: bool
    detail: str
    v2v_ms: float | None
    """First reply audio received - send time of the clip's last speech frame, at the client."""
    server_v2v_ms: float | None
    stages_ms: dict[str, float]
    clip_start_s: float | None
    clip_end_s: float | None
    speech_end_s: float | None
    first_audio_s: float | None
    user: str
    reply: str
    interrupted: bool = False
    reply_gap_ms: float = 0.0
    """Silence heard inside the reply because its next audio came late (the gateway's playout ran dry)."""
    reply_ahead_min_ms: float | None = None
    """How far ahead of the listener the reply's later chunks came, at the tightest (negative: late); None for a
    reply of one chunk."""
    extra_server_turns: int = 0
    """Turns the gateway ended inside this clip (a pause long enough to endpoint)."""
    hangover_ms: int | None = None
    """The silence that committed the turn: the short wait when its score said finished, the score budget when the
    score came too late."""
    turn_score_ms: float | None = None
    """When the LLM's P(turn end) reached the gateway, ms after the end of speech did (0.1: before it; None: none
    came before the commit)."""
    turn_end_from_prefill: bool = False
    """The LLM's score came from a prefill of a partial before the pause: the pause did not wait for the LLM."""
    errors: list[str] = dataclasses.field(default_factory=list)
    """Session errors that arrived during the turn, `stage:code: message`."""


@dataclass(frozen=True)
class LoadTestReport:
    """The report of one load test (loadtest.json)."""

    options: LoadTestOptions
    clips: list[ClipSummary]
    started_at_us: int
    wall_s: float
    machine: Machine
    turns: TurnCounts
    throughput: Throughput
    v2v_ms: Summary
    stages_ms: dict[str, Summary]
    """By stage name (`STAGE_NAMES`), over the turns that finished OK."""
    live_sessions: list[tuple[float, int]]
    """Step points (time since start s, sessions live from then on)."""
    sessions: list[SessionRow]
    per_turn: list[TurnRow]
    files: ReportFiles | None = None

    @property
    def replies_with_gap(self) -> int:
        """Replies (of the turns that finished OK) whose audio ran dry at least once."""
        return sum(1 for turn in self.per_turn if turn.ok and turn.reply_gap_ms > 0)

    @property
    def endpoint_scores(self) -> dict[str, int]:
        """How the OK turns' pauses were scored: by a prefill of a partial before the pause, by the reply to the
        pause in time, or not in time (the pause waited out the score budget, or the session scores no pauses)."""
        ok = [turn for turn in self.per_turn if turn.ok and turn.hangover_ms is not None]
        prefill = sum(1 for turn in ok if turn.turn_end_from_prefill and turn.turn_score_ms is not None)
        scored = sum(1 for turn in ok if turn.turn_score_ms is not None)
        return {"from_prefill": prefill, "in_time": scored - prefill, "none_in_time": len(ok) - scored}

    @property
    def reply_ahead_min_ms(self) -> Summary:
        """Over the replies (of OK turns) of more than one chunk: how far ahead of playout their later work ran,
        at its tightest."""
        return summarize(
            [turn.reply_ahead_min_ms for turn in self.per_turn if turn.ok and turn.reply_ahead_min_ms is not None]
        )

    def _options_json(self) -> dict[str, object]:
        options = dataclasses.asdict(self.options)
        del options["credentials"], options["twilio_auth_token"]  # a token must not land in a report file
        return options

    def to_json(self) -> dict[str, object]:
        """The report as loadtest.json holds it; users' tooling reads these keys."""
        data: dict[str, object] = {
            "kind": "voicemesh.loadtest",
            "config": {**self._options_json(), "clips": [dataclasses.asdict(c) for c in self.clips]},
            "started_at_us": self.started_at_us,
            "wall_s": self.wall_s,
            "machine": dataclasses.asdict(self.machine),
            "turns": dataclasses.asdict(self.turns),
            "throughput": dataclasses.asdict(self.throughput),
            "percentile_method": PERCENTILE_METHOD,
            "v2v_ms": self.v2v_ms.to_json(),
            "stages_ms": {stage: summary.to_json() for stage, summary in self.stages_ms.items()},
            "replies_with_gap": self.replies_with_gap,
            "reply_ahead_min_ms": self.reply_ahead_min_ms.to_json(),
            "endpoint_scores": self.endpoint_scores,
            "live_sessions": [list(step) for step in self.live_sessions],
            "sessions": [dataclasses.asdict(session) for session in self.sessions],
            "per_turn": [dataclasses.asdict(turn) for turn in self.per_turn],
        }
        if self.files is not None:
            data["files"] = dataclasses.asdict(self.files)
        return data


@dataclass(frozen=True)
class SweepLevel:
    """One session count of a sweep: the load test's headline numbers."""

    sessions: int
    within_budget: bool
    """Every turn finished OK and p99 V2V is within the budget."""
    v2v_p50_ms: float | None
    v2v_p95_ms: float | None
    v2v_p99_ms: float | None
    v2v_max_ms: float | None
    turns_ok: int
    turns_failed: int
    failed_by_error: dict[str, int]
    ok_turns_per_min: float
    replies_with_gap: int
    """Replies whose audio ran dry at least once: the stages fell behind playout."""
    queue_medians_ms: dict[str, float | None]
    """p50 of each queue stage (`QUEUE_STAGES`)."""
    stage_p99_ms: dict[str, float | None]
    report: ReportFiles | None = None
    """The level's own load-test report."""

    @classmethod
    def of(cls, report: LoadTestReport, budget_ms: float) -> SweepLevel:
        v2v, counts = report.v2v_ms, report.turns
        return cls(
            sessions=report.options.sessions,
            within_budget=v2v.p99 is not None and v2v.p99 <= budget_ms and counts.failed == 0,
            v2v_p50_ms=v2v.p50,
            v2v_p95_ms=v2v.p95,
            v2v_p99_ms=v2v.p99,
            v2v_max_ms=v2v.max,
            turns_ok=counts.ok,
            turns_failed=counts.failed,
            failed_by_error=counts.failed_by_error,
            ok_turns_per_min=report.throughput.ok_turns_per_min,
            replies_with_gap=report.replies_with_gap,
            queue_medians_ms={stage: report.stages_ms[stage].p50 for stage in QUEUE_STAGES},
            stage_p99_ms={stage: report.stages_ms[stage].p99 for stage in STAGE_NAMES},
            report=report.files,
        )


@dataclass(frozen=True)
class QueueGrowth:
    """Which queue stage's median grew first as sessions rose, compared with the smallest level."""

    threshold_ms: float
    stage: str | None = None
    """None when no queue median grew by more than `threshold_ms`."""
    at_sessions: int | None = None
    grew_ms: float | None = None
    baseline_sessions: int | None = None
    growth_ms: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Every queue's growth (ms) at every level past the baseline, by session count as text."""


@dataclass(frozen=True)
class SweepResult:
    """The result of a capacity sweep (sweep.json)."""

    target: str
    transport: str
    turns_per_session: int
    budget_ms: float
    levels_requested: list[int]
    levels: list[SweepLevel]
    capacity_sessions: int
    """The largest session count within budget, with every level below it within budget too; 0 if none."""
    first_queue_to_grow: QueueGrowth
    machine: Machine
    verdict: str
    files: ReportFiles | None = None

    def to_json(self) -> dict[str, object]:
        """The result as sweep.json holds it; users' tooling reads these keys."""
        data = {"kind": "voicemesh.sweep", **dataclasses.asdict(self)}
        for level in data["levels"]:
            level["report"] = level["report"] or {}
        if self.files is None:
            del data["files"]
        return data


def live_sessions(spans_s: Sequence[tuple[float, float]]) -> list[tuple[float, int]]:
    """Step points (time_s, sessions live from then on) for sessions alive over [start_s, end_s)."""
    changes: dict[float, int] = {}
    for start_s, end_s in spans_s:
        changes[start_s] = changes.get(start_s, 0) + 1
        changes[end_s] = changes.get(end_s, 0) - 1
    steps: list[tuple[float, int]] = [(0.0, 0)]
    live = 0
    for time_s in sorted(changes):
        live += changes[time_s]
        if steps[-1][0] == time_s:
            steps[-1] = (time_s, live)
        else:
            steps.append((time_s, live))
    return steps


def build_report(
    options: LoadTestOptions,
    clips: Sequence[SpeechClip],
    sessions: Sequence[SessionRow],
    turns: Sequence[TurnRow],
    started_at_us: int,
    wall_s: float,
    files: ReportFiles | None = None,
) -> LoadTestReport:
    """The report of one load test from its sessions and turns."""
    ok = [turn for turn in turns if turn.ok]
    failed = [turn for turn in turns if turn.status not in (OK, NOT_STARTED)]
    sessions_with_failures = {turn.session for turn in turns if not turn.ok}
    spans_s = [
        (session.started_s, session.ended_s)
        for session in sessions
        if session.started_s is not None and session.ended_s is not None
    ]
    return LoadTestReport(
        options=options,
        clips=[ClipSummary(clip.name, round(clip.duration_s, 2)) for clip in clips],
        started_at_us=started_at_us,
        wall_s=round(wall_s, 2),
        machine=Machine.here(),
        turns=TurnCounts(
            planned=len(turns),
            ok=len(ok),
            failed=len(failed),
            not_started=len(turns) - len(ok) - len(failed),
            failed_by_error=dict(Counter(turn.status for turn in failed).most_common()),
        ),
        throughput=Throughput(
            ok_turns_per_min=round(len(ok) / wall_s * 60, 2) if wall_s > 0 else 0.0,
            sessions_completed=sum(1 for session in sessions if session.session not in sessions_with_failures),
        ),
        v2v_ms=summarize([turn.v2v_ms for turn in ok if turn.v2v_ms is not None]),
        stages_ms={stage: summarize([turn.stages_ms[stage] for turn in ok]) for stage in STAGE_NAMES},
        live_sessions=[(round(time_s, 3), count) for time_s, count in live_sessions(spans_s)],
        sessions=list(sessions),
        per_turn=list(turns),
        files=files,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_summary(report: LoadTestReport) -> str:
    """The summary table of one load test, for a terminal."""
    options, counts = report.options, report.turns
    lines = [
        f"loadtest {options.target} ({options.transport}): {options.sessions} sessions x {options.turns} turns,"
        f" {options.arrival}{f' over {options.ramp_s:g} s' if options.arrival == 'staggered' else ''},"
        f" wall {report.wall_s} s",
        f"turns: {counts.ok} ok, {counts.failed} failed, {counts.not_started} not started of {counts.planned};"
        f" throughput {report.throughput.ok_turns_per_min} ok turns/min",
        "",
        f"{f'ms (n={report.v2v_ms.count})':<20}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}",
    ]

    def row(name: str, summary: Summary) -> str:
        cells = "".join(f"{_ms(value):>9}" for value in (summary.p50, summary.p95, summary.p99, summary.max))
        return f"{name:<20}{cells}"

    lines.append(row("V2V", report.v2v_ms))
    lines += [row(f"  {stage}", report.stages_ms[stage]) for stage in STAGE_NAMES]
    gaps = [turn.reply_gap_ms for turn in report.per_turn if turn.ok and turn.reply_gap_ms > 0]
    lines.append(
        f"reply gaps: {len(gaps)} of {counts.ok} replies ran dry"
        + (f", longest {max(gaps):.0f} ms, {sum(gaps):.0f} ms in all" if gaps else "")
    )
    ahead = [turn.reply_ahead_min_ms for turn in report.per_turn if turn.ok and turn.reply_ahead_min_ms is not None]
    if ahead:
        lines.append(
            f"later audio ahead of playout, the tightest per reply: p50 {report.reply_ahead_min_ms.p50:.0f} ms,"
            f" least {min(ahead):.0f} ms (n={len(ahead)})"
        )
    scores = report.endpoint_scores
    if any(scores.values()):
        lines.append(
            f"endpoint scores: {scores['from_prefill']} from a partial's prefill, {scores['in_time']} from the reply"
            f" in time, {scores['none_in_time']} pauses took the fixed wait (no score in time)"
        )
    if counts.failed_by_error:
        failures = ", ".join(f"{status} x{count}" for status, count in counts.failed_by_error.items())
        details = {turn.status: turn.detail for turn in report.per_turn if not turn.ok}
        lines += ["", f"failed by error: {failures}"]
        lines += [f"  {status}: {detail}" for status, detail in details.items() if detail and status != NOT_STARTED]
    if report.files is not None:
        lines += ["", f"json  {report.files.json}", f"html  {report.files.html}"]
    return "\n".join(lines)


def format_sweep(result: SweepResult) -> str:
    """The sweep's table and verdict, for a terminal."""
    lines = [
        f"sweep {result.target} ({result.transport}): levels {result.levels_requested},"
        f" {result.turns_per_session} turns each, budget p99 V2V <= {result.budget_ms:g} ms",
        "",
        f"{'sessions':>8}{'ok':>6}{'failed':>8}{'p50 ms':>10}{'p99 ms':>10}  within  queue medians ms",
    ]
    for level in result.levels:
        queues = ", ".join(f"{stage} {'-' if ms is None else ms}" for stage, ms in level.queue_medians_ms.items())
        p50, p99 = level.v2v_p50_ms, level.v2v_p99_ms
        lines.append(
            f"{level.sessions:>8}{level.turns_ok:>6}{level.turns_failed:>8}"
            f"{'-' if p50 is None else p50:>10}{'-' if p99 is None else p99:>10}"
            f"  {'yes' if level.within_budget else 'no':<6}  {queues}"
        )
    lines += ["", result.verdict]
    if result.files is not None:
        lines += [f"json  {result.files.json}", f"html  {result.files.html}"]
    return "\n".join(lines)
