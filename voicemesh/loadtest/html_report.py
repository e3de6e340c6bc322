"""Self-contained HTML reports of a load test or sweep: tables plus inline SVG charts drawn here (no plotting library)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from html import escape

from voicemesh.loadstats import PERCENTILE_METHOD, Summary
from voicemesh.loadtest.report import NOT_STARTED, LoadTestReport, Machine, SweepResult, TurnRow
from voicemesh.stages import QUEUE_STAGES

WIDTH, HEIGHT = 760, 320
LEFT, RIGHT, TOP, BOTTOM = 64, 64, 24, 44
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 980px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0; } td, th { padding: 3px 10px; border-bottom: 1px solid #ddd; }
th { text-align: left; background: #f4f4f4; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.bad { color: #c0392b; } .ok { color: #2e7d32; } .note { color: #666; font-size: 12px; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
"""


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [low, high]."""
    if high <= low:
        high = low + 1
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [round(index * step, 10) for index in range(first, last + 1)]


class _Plot:
    """Maps data to pixels in the plot area and draws axes; `parts` collects the SVG elements."""

    def __init__(self, x_max: float, y_max: float, x_label: str, y_label: str, x_ticks: bool = True) -> None:
        self.x_ticks = nice_ticks(0, x_max)
        self.y_ticks = nice_ticks(0, y_max)
        self.x_max, self.y_max = self.x_ticks[-1], self.y_ticks[-1]
        self.parts: list[str] = []
        for tick in self.y_ticks:
            y = self.y(tick)
            self.parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#eee"/>')
            self.parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_num(tick)}</text>')
        for tick in self.x_ticks if x_ticks else []:
            x = self.x(tick)
            self.parts.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{_num(tick)}</text>')
        self.parts.append(
            f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" stroke="#888"/>'
            f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" stroke="#888"/>'
            f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 8}" text-anchor="middle">{escape(x_label)}</text>'
            f'<text transform="translate(14 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" text-anchor="middle">'
            f"{escape(y_label)}</text>"
        )

    def x(self, value: float) -> float:
        return LEFT + value / self.x_max * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        return HEIGHT - BOTTOM - value / self.y_max * (HEIGHT - TOP - BOTTOM)

    def svg(self, title: str) -> str:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}"'
            f' role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>{"".join(self.parts)}</svg>'
        )


def _num(value: float) -> str:
    return f"{value:g}" if abs(value) < 1e6 else f"{value:.3g}"


def _empty(title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="60" role="img" aria-label="{escape(title)}">'
        f'<title>{escape(title)}</title><text x="{LEFT}" y="34">no completed turns to plot</text></svg>'
    )


def cdf_chart(v2v_ms: Sequence[float], marks_ms: Mapping[str, float | None]) -> str:
    """Empirical CDF of V2V with dashed lines at the given percentiles."""
    title = "V2V CDF"
    if not v2v_ms:
        return _empty(title)
    ordered = sorted(v2v_ms)
    plot = _Plot(ordered[-1] * 1.05, 1.0, "V2V (ms)", "fraction of turns")
    points = [f"{plot.x(0):.1f},{plot.y(0):.1f}", f"{plot.x(ordered[0]):.1f},{plot.y(0):.1f}"]
    for index, value in enumerate(ordered):
        points.append(f"{plot.x(value):.1f},{plot.y(index / len(ordered)):.1f}")
        points.append(f"{plot.x(value):.1f},{plot.y((index + 1) / len(ordered)):.1f}")
    plot.parts.append(f'<polyline fill="none" stroke="{PALETTE[0]}" stroke-width="2" points="{" ".join(points)}"/>')
    marks = [(name, value) for name, value in marks_ms.items() if value is not None]
    for row, (name, value) in enumerate(marks):
        x = plot.x(value)
        plot.parts.append(
            f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM}" stroke="#555" stroke-dasharray="4 3"/>'
            f'<text x="{x + 3:.1f}" y="{TOP + 12 + 13 * row}">{escape(name)} {value:.0f}</text>'
        )
    return plot.svg(title)


def timeline_chart(turns: Sequence[TurnRow], live: Sequence[tuple[float, int]], wall_s: float) -> str:
    """V2V of each turn at the moment its speech ended, failed turns as red crosses, live sessions on the right."""
    title = "V2V over time against live sessions"
    ok = [(t.speech_end_s, t.v2v_ms) for t in turns if t.ok and t.speech_end_s is not None and t.v2v_ms is not None]
    failed = [t for t in turns if not t.ok and t.status != NOT_STARTED]
    if not ok and not failed:
        return _empty(title)
    plot = _Plot(max(wall_s, 1.0), max([v for _, v in ok], default=1.0) * 1.1, "time since start (s)", "V2V (ms)")
    for time_s, v2v in ok:
        plot.parts.append(
            f'<circle cx="{plot.x(time_s):.1f}" cy="{plot.y(v2v):.1f}" r="3.5" fill="{PALETTE[0]}">'
            f"<title>{time_s:.1f} s: {v2v:.0f} ms</title></circle>"
        )
    for turn in failed:
        time_s = turn.clip_end_s or turn.clip_start_s or 0.0
        x, y = plot.x(min(time_s, plot.x_max)), plot.y(0) - 6
        plot.parts.append(
            f'<path d="M{x - 4:.1f},{y - 4:.1f} l8,8 m0,-8 l-8,8" stroke="#c0392b" stroke-width="2">'
            f"<title>session {turn.session} turn {turn.turn}: {escape(turn.status)}</title></path>"
        )
    peak = max((count for _, count in live), default=0)
    if peak:
        axis = nice_ticks(0, peak, min(peak, 5))
        top = axis[-1]

        def live_y(count: float) -> float:
            return HEIGHT - BOTTOM - count / top * (HEIGHT - TOP - BOTTOM)

        steps: list[str] = []
        for index, (time_s, count) in enumerate(live):
            end_s = live[index + 1][0] if index + 1 < len(live) else plot.x_max
            steps.append(f"{plot.x(time_s):.1f},{live_y(count):.1f} {plot.x(end_s):.1f},{live_y(count):.1f}")
        plot.parts.append(
            f'<polyline fill="none" stroke="{PALETTE[1]}" stroke-width="1.5" points="{" ".join(steps)}"/>'
        )
        for tick in axis:
            plot.parts.append(f'<text x="{WIDTH - RIGHT + 6}" y="{live_y(tick) + 4:.1f}">{_num(tick)}</text>')
        plot.parts.append(
            f'<text transform="translate({WIDTH - 14} {(TOP + HEIGHT - BOTTOM) / 2}) rotate(90)" text-anchor="middle"'
            f' fill="{PALETTE[1]}">live sessions</text>'
        )
    return plot.svg(title)


def stacked_stages_chart(stages_ms: Mapping[str, Summary], v2v_ms: Summary) -> str:
    """One bar per percentile, stacked from each stage's own value at it, with V2V at that percentile marked."""
    title = "Stages stacked at p50, p95, p99"
    v2v_at = {key: value for key, value in v2v_ms.percentiles().items() if value is not None}
    if not v2v_at:
        return _empty(title)
    stage_at = {stage: summary.percentiles() for stage, summary in stages_ms.items()}
    totals = [sum(at[key] or 0.0 for at in stage_at.values()) for key in v2v_at]
    y_max = max([*totals, *v2v_at.values()]) * 1.1
    plot = _Plot(1.0, y_max, "", "milliseconds", x_ticks=False)
    bar_w = 90
    for column, (key, v2v) in enumerate(v2v_at.items()):
        x = LEFT + 60 + column * 150
        base = 0.0
        for color, (stage, at) in zip(PALETTE, stage_at.items(), strict=False):
            value = at[key] or 0.0
            if value <= 0:
                continue
            y_top, y_bottom = plot.y(base + value), plot.y(base)
            plot.parts.append(
                f'<rect x="{x}" y="{y_top:.1f}" width="{bar_w}" height="{max(y_bottom - y_top, 0.5):.1f}" fill="{color}">'
                f"<title>{escape(stage)} {key}: {value:.1f} ms</title></rect>"
            )
            base += value
        v2v_y = plot.y(v2v)
        plot.parts.append(
            f'<line x1="{x - 8}" y1="{v2v_y:.1f}" x2="{x + bar_w + 8}" y2="{v2v_y:.1f}" stroke="#111" stroke-width="2"/>'
            f'<text x="{x + bar_w / 2}" y="{v2v_y - 5:.1f}" text-anchor="middle">V2V {v2v:.0f}</text>'
            f'<text x="{x + bar_w / 2}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{key}</text>'
        )
    for row, (color, stage) in enumerate(zip(PALETTE, stages_ms, strict=False)):
        y = TOP + row * 16
        plot.parts.append(
            f'<rect x="{WIDTH - 170}" y="{y}" width="10" height="10" fill="{color}"/>'
            f'<text x="{WIDTH - 154}" y="{y + 9}">{escape(stage)}</text>'
        )
    return plot.svg(title)


def line_chart(
    x_values: Sequence[float],
    series: Mapping[str, Sequence[float | None]],
    x_label: str,
    y_label: str,
    title: str,
    budget: float | None = None,
) -> str:
    """Lines with dots over a shared x axis (e.g. session count); None values are gaps."""
    values = [v for points in series.values() for v in points if v is not None]
    if not x_values or not values:
        return _empty(title)
    plot = _Plot(max(x_values), max([*values, budget or 0]) * 1.1, x_label, y_label)
    if budget is not None:
        y = plot.y(budget)
        plot.parts.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#c0392b" stroke-dasharray="4 3"/>'
            f'<text x="{LEFT + 4}" y="{y - 4:.1f}">budget {budget:g}</text>'
        )
    for row, (color, (name, points)) in enumerate(zip(PALETTE, series.items(), strict=False)):
        pairs = [(x, v) for x, v in zip(x_values, points, strict=False) if v is not None]
        path = " ".join(f"{plot.x(x):.1f},{plot.y(v):.1f}" for x, v in pairs)
        plot.parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        for x, v in pairs:
            plot.parts.append(
                f'<circle cx="{plot.x(x):.1f}" cy="{plot.y(v):.1f}" r="3.5" fill="{color}"><title>{escape(name)}'
                f" at {x:g}: {v:.1f}</title></circle>"
            )
        plot.parts.append(
            f'<rect x="{WIDTH - 170}" y="{TOP + row * 16}" width="10" height="10" fill="{color}"/>'
            f'<text x="{WIDTH - 154}" y="{TOP + row * 16 + 9}">{escape(name)}</text>'
        )
    return plot.svg(title)


def _cell(value: object) -> str:
    if value is None:
        return '<td class="n">-</td>'
    if isinstance(value, float | int) and not isinstance(value, bool):
        return f'<td class="n">{value:g}</td>'
    return f"<td>{escape(str(value))}</td>"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _machine(machine: Machine) -> str:
    return f"on {machine.host}: {machine.cpus} CPUs, Python {machine.python}"


def _page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{body}</body></html>\n"
    )


def _summary_row(name: str, summary: Summary) -> list[object]:
    return [name, summary.p50, summary.p95, summary.p99, summary.max, summary.mean, summary.count]


def render_report(report: LoadTestReport) -> str:
    """The HTML page of one load test: summary table, failures, the three charts, every turn."""
    options, counts, v2v = report.options, report.turns, report.v2v_ms
    summary_rows = [_summary_row("V2V", v2v)] + [_summary_row(name, s) for name, s in report.stages_ms.items()]
    ok_v2v = [t.v2v_ms for t in report.per_turn if t.ok and t.v2v_ms is not None]
    clips = ", ".join(clip.name for clip in report.clips)
    parts = [
        "<h1>voicemesh load test</h1>",
        f"<p>{escape(options.target)} over {escape(options.transport)}: {options.sessions} sessions"
        f" &times; {options.turns} turns, ramp {options.ramp_s} s, wall {report.wall_s} s; clips {escape(clips)};"
        f" {escape(_machine(report.machine))}</p>",
        f'<p><b class="ok">{counts.ok} ok</b>, <b class="{"bad" if counts.failed else "ok"}">'
        f"{counts.failed} failed</b>, {counts.not_started} not started of {counts.planned} turns;"
        f" throughput {report.throughput.ok_turns_per_min} ok turns/min</p>",
        "<h2>Latency (ms)</h2>",
        _table(["", "p50", "p95", "p99", "max", "mean", "count"], summary_rows),
        f'<p class="note">Percentiles: {escape(PERCENTILE_METHOD)}. V2V is measured at the'
        " client: first reply audio received - send time of the clip's last speech frame. Stages come from the"
        " gateway's per-turn metrics (downlink: client receipt - gateway send).</p>",
    ]
    if counts.failed_by_error:
        parts += ["<h2>Failed turns by error</h2>", _table(["status", "turns"], list(counts.failed_by_error.items()))]
    parts += [
        "<h2>V2V CDF</h2>",
        cdf_chart(ok_v2v, v2v.percentiles()),
        "<h2>V2V over time against live sessions</h2>",
        timeline_chart(report.per_turn, report.live_sessions, report.wall_s),
        "<h2>Stages stacked at p50 / p95 / p99</h2>",
        stacked_stages_chart(report.stages_ms, v2v),
        '<p class="note">Each segment is that stage\'s own percentile, so the stack need not add up to V2V at the'
        " same percentile (the black line); stages can also overlap (speculative start).</p>",
        "<h2>Every turn</h2>",
        _table(
            ["session", "turn", "clip", "status", "V2V ms", "server V2V ms", "you said", "reply", "detail"],
            [
                [t.session, t.turn, t.clip, t.status, t.v2v_ms, t.server_v2v_ms, t.user, t.reply, t.detail]
                for t in report.per_turn
            ],
        ),
    ]
    return _page("voicemesh load test", "".join(parts))


def render_sweep(result: SweepResult) -> str:
    """The HTML page of a sweep: verdict, V2V and queue medians against session count, links to each level."""
    levels = result.levels
    sessions = [float(level.sessions) for level in levels]
    here = os.path.dirname(result.files.html) if result.files is not None else "."
    rows = []
    for level in levels:
        link = (
            f'<a href="{escape(os.path.relpath(level.report.html, here))}">report</a>'
            if level.report is not None
            else ""
        )
        numbers = (
            level.sessions,
            level.turns_ok,
            level.turns_failed,
            level.v2v_p50_ms,
            level.v2v_p95_ms,
            level.v2v_p99_ms,
            level.ok_turns_per_min,
        )
        rows.append(
            "<tr>"
            + "".join(_cell(value) for value in numbers)
            + _cell("yes" if level.within_budget else "no")
            + "".join(_cell(level.queue_medians_ms[stage]) for stage in QUEUE_STAGES)
            + f"<td>{link}</td></tr>"
        )
    header = ["sessions", "ok", "failed", "p50 ms", "p95 ms", "p99 ms", "ok turns/min", "within", *QUEUE_STAGES, ""]
    parts = [
        "<h1>voicemesh capacity sweep</h1>",
        f"<p>{escape(result.target)} over {escape(result.transport)},"
        f" {result.turns_per_session} turns per session, budget p99 V2V &le; {result.budget_ms} ms;"
        f" {escape(_machine(result.machine))}</p>",
        f"<p><b>{escape(result.verdict)}</b></p>",
        "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>" + "".join(rows) + "</table>",
        "<h2>V2V against sessions</h2>",
        line_chart(
            sessions,
            {"p50": [level.v2v_p50_ms for level in levels], "p99": [level.v2v_p99_ms for level in levels]},
            "concurrent sessions",
            "V2V (ms)",
            "V2V against sessions",
            budget=result.budget_ms,
        ),
        "<h2>Queue medians against sessions</h2>",
        line_chart(
            sessions,
            {stage: [level.queue_medians_ms[stage] for level in levels] for stage in QUEUE_STAGES},
            "concurrent sessions",
            "median wait (ms)",
            "Queue medians against sessions",
        ),
    ]
    return _page("voicemesh capacity sweep", "".join(parts))
