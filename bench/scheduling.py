"""Deadline scheduling against first come, first served, side by side in one run (issue 13).

`deadline` is the mesh as shipped: the LLM decodes up to 8 replies in one batch, and a reply past its urgent
words sits out the steps that carry another's urgent work while its audio is far from running dry; the TTS
synthesizes chunks earliest deadline first; the ASR decodes partials on a niced model copy of their own. `fifo` is
the mesh before any of it (`VOICEMESH_LLM_MAX_BATCH=1`, `VOICEMESH_LLM_YIELD_TO_NEW_TURNS=false`,
`VOICEMESH_TTS_SCHEDULE_BY_DEADLINE=false`, `VOICEMESH_ASR_PARTIAL_NICE=0`): one reply at a time, and every stage
serves work in the order it arrives. `--variant` isolates one change (e.g. `VOICEMESH_LLM_MAX_BATCH=1` against
8). Both leave the LLM's flow control off (`VOICEMESH_LLM_MAX_AHEAD_S=0`, the default).

Each round starts a fresh local mesh per variant and arrival mode (the variants take turns going first) and runs
`voicemesh loadtest` at every session count on it; turns are pooled over the rounds, so each level's percentiles
come from rounds x sessions x turns turns.

`python -m bench.scheduling [--levels 1,2,4,6,8] [--arrival sync,staggered] [--turns 3] [--rounds 1]` prints JSON:
per arrival mode, level and variant the V2V percentiles, failed turns, the replies that ran dry (and for how long
in all), how far ahead of playout later chunks came, the queue medians; per level the ratio of the second variant
to the first (deadline / fifo) of V2V p50 and p99; and each variant's capacity (the most sessions, from 1 up, with
p99 V2V <= --budget-ms and no failed turn).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.variants import environment as variant_environment
from bench.variants import parse_variant
from voicemesh.loadstats import summarize
from voicemesh.loadtest import LoadTestOptions
from voicemesh.loadtest.capacity import DEFAULT_BUDGET_MS
from voicemesh.loadtest.driver import loadtest
from voicemesh.loadtest.report import TurnRow
from voicemesh.mesh import started_local_mesh
from voicemesh.stages import QUEUE_STAGES

CLIPS = Path(__file__).resolve().parents[2] / "shared" / "audio"
VARIANTS: dict[str, dict[str, str]] = {
    "fifo": {
        "VOICEMESH_LLM_MAX_BATCH": "1",
        "VOICEMESH_LLM_YIELD_TO_NEW_TURNS": "false",
        "VOICEMESH_LLM_MAX_AHEAD_S": "0",
        "VOICEMESH_TTS_SCHEDULE_BY_DEADLINE": "false",
        "VOICEMESH_ASR_PARTIAL_NICE": "0",
    },
    "deadline": {
        "VOICEMESH_LLM_MAX_BATCH": "8",
        "VOICEMESH_LLM_YIELD_TO_NEW_TURNS": "true",
        "VOICEMESH_LLM_MAX_AHEAD_S": "0",
        "VOICEMESH_TTS_SCHEDULE_BY_DEADLINE": "true",
        "VOICEMESH_ASR_PARTIAL_NICE": "10",
    },
}


async def _round(
    variant: str, environment: dict[str, str], options: LoadTestOptions, levels: Sequence[int]
) -> dict[int, list[TurnRow]]:
    """One fresh mesh of `variant` (its `environment`); a load test at each level on it."""
    rows: dict[int, list[TurnRow]] = {}
    with variant_environment(environment):
        async with started_local_mesh(f"voicemesh-bench-{variant}-") as target:
            for sessions in levels:
                report = await loadtest(dataclasses.replace(options, target=target, sessions=sessions))
                rows[sessions] = report.per_turn
                print(
                    f"{variant} {options.arrival} x{sessions}: p50 {report.v2v_ms.p50} p99 {report.v2v_ms.p99} ms",
                    file=sys.stderr,
                )
    return rows


def level_summary(rows: Sequence[TurnRow], budget_ms: float) -> dict[str, object]:
    """What one level's pooled turns show."""
    ok = [row for row in rows if row.ok]
    v2v = summarize([row.v2v_ms for row in ok if row.v2v_ms is not None])
    gaps = [row.reply_gap_ms for row in ok if row.reply_gap_ms > 0]
    return {
        "turns": len(rows),
        "failed": len(rows) - len(ok),
        "v2v_ms": v2v.to_json(),
        "within_budget": v2v.p99 is not None and v2v.p99 <= budget_ms and len(ok) == len(rows),
        "replies_with_gap": len(gaps),
        "gap_ms_total": round(sum(gaps), 1),
        "gap_ms_longest": round(max(gaps, default=0.0), 1),
        "reply_ahead_min_ms": summarize(
            [row.reply_ahead_min_ms for row in ok if row.reply_ahead_min_ms is not None]
        ).to_json(),
        "queue_p50_ms": {
            stage: summarize([row.stages_ms[stage] for row in ok if stage in row.stages_ms]).p50
            for stage in QUEUE_STAGES
        },
    }


def _ratio(new: float | None, old: float | None) -> float | None:
    return None if new is None or not old else round(new / old, 3)


def run(
    levels: Sequence[int] = (1, 2, 4, 6, 8),
    arrivals: Sequence[str] = ("sync", "staggered"),
    turns: int = 3,
    rounds: int = 1,
    budget_ms: float = DEFAULT_BUDGET_MS,
    audio: Sequence[str] = (str(CLIPS),),
    variants: dict[str, dict[str, str]] = VARIANTS,
) -> dict[str, object]:
    """Each variant (name: its environment) at each level and arrival mode; ratios of the second to the first."""
    first, second = list(variants)[:2]
    pooled: dict[tuple[str, str, int], list[TurnRow]] = {}
    for round_index in range(rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        for arrival in arrivals:
            options = LoadTestOptions(target="", turns=turns, audio=tuple(audio), arrival=arrival, seed=round_index)
            for variant in order:
                for sessions, rows in asyncio.run(_round(variant, variants[variant], options, levels)).items():
                    pooled.setdefault((arrival, variant, sessions), []).extend(rows)
    results: dict[str, object] = {}
    for arrival in arrivals:
        by_level: dict[str, object] = {}
        capacity = dict.fromkeys(variants, 0)
        growing = dict.fromkeys(variants, True)
        for sessions in levels:
            summaries = {variant: level_summary(pooled[arrival, variant, sessions], budget_ms) for variant in variants}
            for variant, summary in summaries.items():
                growing[variant] = growing[variant] and bool(summary["within_budget"])
                if growing[variant]:
                    capacity[variant] = sessions
            new, old = summaries[second]["v2v_ms"], summaries[first]["v2v_ms"]
            assert isinstance(new, dict) and isinstance(old, dict)
            by_level[str(sessions)] = {
                **summaries,
                f"{second}_over_{first}": {key: _ratio(new[key], old[key]) for key in ("p50", "p99")},
            }
        results[arrival] = {"levels": by_level, f"capacity_at_p99_{budget_ms:g}_ms": capacity}
    return {
        "benchmark": "scheduling",
        "started_load_avg": os.getloadavg(),
        "cpus": len(os.sched_getaffinity(0)),
        "rounds": rounds,
        "turns_per_session": turns,
        "audio": list(audio),
        "variants": variants,
        "results": results,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,2,4,6,8", help="session counts, comma-separated")
    parser.add_argument("--arrival", default="sync,staggered", help="arrival modes, comma-separated")
    parser.add_argument("--turns", type=int, default=3, help="turns per session")
    parser.add_argument("--rounds", type=int, default=1, help="fresh meshes per variant and arrival mode")
    parser.add_argument("--budget-ms", type=float, default=DEFAULT_BUDGET_MS, help="p99 V2V budget for capacity")
    parser.add_argument("--audio", nargs="+", default=[str(CLIPS)], help="WAV files or directories")
    parser.add_argument(
        "--variant",
        action="append",
        metavar="NAME:VAR=VALUE,...",
        help="compare these meshes instead of fifo and deadline (twice or more; ratios are of the second to the "
        "first), e.g. --variant free:VOICEMESH_LLM_MAX_AHEAD_S=0 --variant paced:VOICEMESH_LLM_MAX_AHEAD_S=3",
    )
    args = parser.parse_args(argv)
    variants = dict(parse_variant(text) for text in args.variant) if args.variant else VARIANTS
    if len(variants) < 2:
        parser.error("give two or more --variant, each NAME:VAR=VALUE[,VAR=VALUE]")
    started = time.monotonic()
    result = run(
        [int(level) for level in args.levels.split(",")],
        args.arrival.split(","),
        args.turns,
        args.rounds,
        args.budget_ms,
        args.audio,
        variants,
    )
    result["wall_s"] = round(time.monotonic() - started, 1)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
