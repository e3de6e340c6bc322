"""Benchmarks: each prints JSON; `python -m bench` runs them all and writes bench/results/."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from voicemesh.loadstats import summarize


def print_result(result: dict[str, object], drop: str | None = None) -> None:
    """A benchmark's result on stdout as indented JSON, without the key `drop` (per-item detail not asked for)."""
    if drop is not None:
        result.pop(drop, None)
    json.dump(result, sys.stdout, indent=2)
    print()


def clips_main(
    prog: str,
    doc: str,
    clips: Sequence[str],
    run: Callable[[int, list[str]], Coroutine[Any, Any, dict[str, Any]]],
    argv: Sequence[str] | None = None,
) -> None:
    """The command line of a benchmark that speaks clips in rounds (--rounds, --clips, --out): runs `run` and prints
    its JSON (also to --out)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per door, alternating which goes first")
    parser.add_argument("--clips", default=",".join(clips), help="comma-separated clip names (harness/clips.py)")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args.rounds, [name for name in args.clips.split(",") if name]))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def door_gap(
    v2v: dict[str, list[float]], from_clip_end: dict[str, list[float]], door: str, name: str, target_gap_ms: float
) -> dict[str, Any]:
    """Per-door V2V summaries (load-test measure and from the clip's end), and `door`'s p50 less gRPC's (as
    `<name>_minus_grpc_p50_ms`) against `target_gap_ms`."""
    gap = None
    if v2v["grpc"] and v2v[door]:
        gap = round(float(np.percentile(v2v[door], 50) - np.percentile(v2v["grpc"], 50)), 1)
    return {
        "v2v_ms": {key: summarize(values).to_json() for key, values in v2v.items()},
        "from_clip_end_ms": {key: summarize(values).to_json() for key, values in from_clip_end.items()},
        f"{name}_minus_grpc_p50_ms": gap,
        "target_gap_ms": target_gap_ms,
        "within_target": gap is not None and gap <= target_gap_ms,
    }
