"""`python -m bench.chaos`: the fault and fuzz suite, one JSON document.

- fuzz: every door (Converse, each service, the WebSocket, /api/offer) with hypothesis-made input;
- faults: SIGKILL, SIGSTOP and SIGTERM of one of two replicas of each stage, mid-conversation, under load;
- soak: conversations back to back with one replica restarted halfway; RSS and task-count slopes.

Targets: 0 lost turns, 0 lost frames, 0 crashes, recovery p99 <= 2 s. `--quick` is the short version of what
`make test` runs (tests/integration/test_chaos.py); the faults and the fuzz themselves live in harness/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any

from bench.chaos import soak
from harness import faults
from harness.clips import load_clip
from harness.faults import DEFAULT_CLIPS, KINDS, QUICK_FAULTS, STAGES


async def run(args: argparse.Namespace) -> dict[str, Any]:
    clips = [load_clip(name) for name in args.clips.split(",")]
    mesh = faults.two_replicas()
    report: dict[str, Any] = {"sessions": args.sessions, "clips": args.clips.split(",")}
    started = time.monotonic()
    try:
        await mesh.wait(timeout_s=300)
        if args.fuzz_examples:
            from harness.fuzz import run_fuzz

            report["fuzz"] = await run_fuzz(mesh, examples=args.fuzz_examples)
        results = []
        for stage, kind in args.faults or faults.faults(args.stages.split(","), args.kinds.split(",")):
            result = await faults.run_fault(mesh, stage, kind, clips, args.sessions, args.utterances)
            results.append(faults.as_json(result))
            print(json.dumps({"fault": f"{stage}:{kind}", "survived": result.survived}), file=sys.stderr)
        report["faults"] = results
        report["totals"] = totals(results)
        if args.soak_s:
            report["soak"] = soak.as_json(await soak.run_soak(mesh, clips, args.soak_s, args.sessions))
    finally:
        mesh.stop_all()
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def totals(results: list[dict[str, Any]]) -> dict[str, Any]:
    recovery = [v for r in results for v in r["recovery_ms"]["values"]]
    keys = (
        "turns_attempted",
        "turns_completed",
        "turns_interrupted",
        "turns_lost",
        "reply_frames",
        "reply_frames_lost",
    )
    summed = {key: sum(r[key] for r in results) for key in keys}
    return {
        "faults": len(results),
        "survived": sum(bool(r["survived"]) for r in results),
        **summed,
        "input_frames_unacknowledged": sum(r["input_frames_unacknowledged"] for r in results),
        "recovery_ms": faults.summary([float(v) for v in recovery]),
        "recovery_excess_ms": faults.summary([float(v) for r in results for v in r["recovery_excess_values"]]),
        "reply_gap_ms": faults.summary([float(v) for r in results for v in r["reply_gap_ms"]["values"]]),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.set_defaults(faults=None)
    parser.add_argument("--sessions", type=int, default=4, help="conversations talking when a fault strikes")
    parser.add_argument("--utterances", type=int, default=4, help="turns per conversation")
    parser.add_argument("--clips", default=",".join(DEFAULT_CLIPS))
    parser.add_argument("--soak-s", type=float, default=600.0, help="soak length (0: none)")
    parser.add_argument("--fuzz-examples", type=int, default=200, help="hypothesis examples per door (0: none)")
    parser.add_argument(
        "--quick", action="store_true", help="the short version: 2 sessions of 2 turns, one fault a stage, no soak"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.utterances, args.soak_s, args.fuzz_examples = 2, 2, 0.0, 20
        args.faults = QUICK_FAULTS
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(asyncio.run(run(parse(argv))), indent=2))


if __name__ == "__main__":
    main()
