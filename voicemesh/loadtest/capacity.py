"""Capacity sweep: load tests at rising session counts, the largest within a p99 V2V budget, which queue grew first,
and the verdict in words."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from voicemesh.loadtest.driver import loadtest, on_target
from voicemesh.loadtest.html_report import render_sweep
from voicemesh.loadtest.options import LoadTestError, LoadTestOptions, check_options
from voicemesh.loadtest.report import Machine, QueueGrowth, ReportFiles, SweepLevel, SweepResult
from voicemesh.stages import QUEUE_STAGES

log = logging.getLogger(__name__)

DEFAULT_BUDGET_MS = 1500.0
DEFAULT_QUEUE_THRESHOLD_MS = 25.0


def capacity(levels: Sequence[SweepLevel]) -> int:
    """Largest session count of the consecutive within-budget levels from the smallest; 0 if the first is over."""
    best = 0
    for level in sorted(levels, key=lambda level: level.sessions):
        if not level.within_budget:
            break
        best = level.sessions
    return best


def queue_growth(levels: Sequence[SweepLevel], threshold_ms: float = DEFAULT_QUEUE_THRESHOLD_MS) -> QueueGrowth:
    """Which queue stage's median grew first as sessions rose, compared with the smallest level.

    Levels are visited in order of session count; the first one where some queue's median exceeds its
    baseline by more than `threshold_ms` names the stage that grew the most there.
    """
    ordered = sorted(levels, key=lambda level: level.sessions)
    if len(ordered) < 2:
        return QueueGrowth(threshold_ms)
    base = ordered[0].queue_medians_ms
    growth_by_level = {
        str(level.sessions): {
            stage: round(median_ms - base_ms, 1)
            for stage in QUEUE_STAGES
            if (median_ms := level.queue_medians_ms.get(stage)) is not None and (base_ms := base.get(stage)) is not None
        }
        for level in ordered[1:]
    }
    result = QueueGrowth(threshold_ms, baseline_sessions=ordered[0].sessions, growth_ms=growth_by_level)
    for level in ordered[1:]:
        grown = {stage: ms for stage, ms in growth_by_level[str(level.sessions)].items() if ms > threshold_ms}
        if grown:
            stage = max(grown, key=lambda name: grown[name])
            return dataclasses.replace(result, stage=stage, at_sessions=level.sessions, grew_ms=grown[stage])
    return result


def verdict(levels: Sequence[SweepLevel], best: int, budget_ms: float, growth: QueueGrowth) -> str:
    """The sweep's answer in one sentence: capacity within budget, and the queue that grew first."""
    if best:
        at_best = next(level for level in levels if level.sessions == best)
        text = f"{best} session(s) within budget: p99 V2V {at_best.v2v_p99_ms} ms <= {budget_ms:g} ms on this machine"
    else:
        text = f"no level within budget (p99 V2V <= {budget_ms:g} ms, no failed turns) on this machine"
    if growth.stage:
        text += (
            f"; {growth.stage} grew first: +{growth.grew_ms} ms median at {growth.at_sessions} sessions"
            f" vs {growth.baseline_sessions}"
        )
    elif len(levels) > 1:
        text += f"; no queue median grew by more than {growth.threshold_ms:g} ms"
    return text


async def sweep(
    options: LoadTestOptions,
    levels: Sequence[int],
    budget_ms: float = DEFAULT_BUDGET_MS,
    out_dir: str | Path | None = None,
    stop_over_budget: bool = True,
    queue_threshold_ms: float = DEFAULT_QUEUE_THRESHOLD_MS,
) -> SweepResult:
    """Load tests at rising session counts: the largest within `budget_ms` of p99 V2V, and which queue grew first.

    A level is within budget when every turn succeeded and its p99 V2V is at most `budget_ms`. With
    `stop_over_budget`, the sweep ends at the first level over it (higher ones would only overload further).
    Writes sweep.json/.html into `out_dir`, and each level's report into `out_dir/sessions-N/`.
    """
    ordered = sorted(set(levels))
    if not ordered or ordered[0] < 1:
        raise LoadTestError(f"sweep levels {list(levels)}: give session counts of 1 or more, e.g. 1,2,4,8")
    check_options(dataclasses.replace(options, sessions=ordered[-1]))
    results: list[SweepLevel] = []
    for sessions in ordered:
        level_dir = None if out_dir is None else Path(out_dir) / f"sessions-{sessions}"
        report = await loadtest(dataclasses.replace(options, sessions=sessions), level_dir)
        level = SweepLevel.of(report, budget_ms)
        results.append(level)
        log.info(
            "sweep level done",
            extra={"sessions": sessions, "v2v_p99_ms": level.v2v_p99_ms, "within": level.within_budget},
        )
        if stop_over_budget and not level.within_budget:
            break
    best = capacity(results)
    growth = queue_growth(results, queue_threshold_ms)
    result = SweepResult(
        target=options.target,
        transport=options.transport,
        turns_per_session=options.turns,
        budget_ms=budget_ms,
        levels_requested=ordered,
        levels=results,
        capacity_sessions=best,
        first_queue_to_grow=growth,
        machine=Machine.here(),
        verdict=verdict(results, best, budget_ms, growth),
        files=None if out_dir is None else ReportFiles.under(out_dir, "sweep"),
    )
    if result.files is not None:
        result.files.write(result.to_json(), render_sweep(result))
    return result


def run_sweep(
    options: LoadTestOptions,
    levels: Sequence[int] = (1, 2, 4, 8),
    budget_ms: float = DEFAULT_BUDGET_MS,
    out_dir: str | Path | None = None,
    stop_over_budget: bool = True,
) -> SweepResult:
    """`sweep` from synchronous code; an empty `options.target` starts (and stops) a local mesh for it."""
    return on_target(options, lambda resolved: sweep(resolved, levels, budget_ms, out_dir, stop_over_budget))
