"""Statistics of a load test, with no network: percentiles, summaries, live sessions over time, capacity.

Percentiles use linear interpolation between closest ranks (Hyndman & Fan type 7, numpy's default, Excel's
PERCENTILE.INC): for sorted values x[0..n-1], the q-th percentile is at rank r = (n - 1) * q / 100, and the
result is x[floor(r)] + (r - floor(r)) * (x[ceil(r)] - x[floor(r)]). With one value every percentile is it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from voicemesh.stages import QUEUE_STAGES

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values` by linear interpolation (see the module docstring)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} is outside 0-100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, p50, p95, p99, max and mean in the values' unit, rounded to 0.1; None for each with no values."""
    if not values:
        return {"count": 0, "p50": None, "p95": None, "p99": None, "max": None, "mean": None}
    summary: dict[str, float | int | None] = {"count": len(values)}
    for q in PERCENTILES:
        summary[f"p{q}"] = round(percentile(values, q), 1)
    summary["max"] = round(max(values), 1)
    summary["mean"] = round(sum(values) / len(values), 1)
    return summary


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


def capacity(levels: Sequence[Mapping[str, object]]) -> int:
    """Largest session count of the consecutive within-budget levels from the smallest; 0 if the first is over."""
    best = 0
    for level in sorted(levels, key=lambda level: int(level["sessions"])):  # type: ignore[call-overload]
        if not level["within_budget"]:
            break
        best = int(level["sessions"])  # type: ignore[call-overload]
    return best


def queue_growth(levels: Sequence[Mapping[str, object]], threshold_ms: float = 25.0) -> dict[str, object]:
    """Which queue stage's median grew first as sessions rose, compared with the smallest level.

    Levels are visited in order of session count; the first one where some queue's median exceeds its
    baseline by more than `threshold_ms` names the stage that grew the most there. `growth_ms` holds every
    queue's growth at every level, for the report.
    """
    ordered = sorted(levels, key=lambda level: int(level["sessions"]))  # type: ignore[call-overload]
    result: dict[str, object] = {"stage": None, "at_sessions": None, "grew_ms": None, "threshold_ms": threshold_ms}
    if len(ordered) < 2:
        result["growth_ms"] = {}
        return result
    base: Mapping[str, float | None] = ordered[0]["queue_medians_ms"]  # type: ignore[assignment]
    result["baseline_sessions"] = ordered[0]["sessions"]
    growth_by_level: dict[str, dict[str, float]] = {}
    for level in ordered[1:]:
        medians: Mapping[str, float | None] = level["queue_medians_ms"]  # type: ignore[assignment]
        growth = {
            stage: round(medians[stage] - base[stage], 1)  # type: ignore[operator]
            for stage in QUEUE_STAGES
            if medians.get(stage) is not None and base.get(stage) is not None
        }
        growth_by_level[str(level["sessions"])] = growth
        grown = {stage: ms for stage, ms in growth.items() if ms > threshold_ms}
        if grown and result["stage"] is None:
            stage = max(grown, key=lambda name: grown[name])
            result.update(stage=stage, at_sessions=level["sessions"], grew_ms=grown[stage])
    result["growth_ms"] = growth_by_level
    return result
