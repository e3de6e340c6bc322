"""`voicemesh loadtest`: one load test or a capacity sweep from the command line; a table, then JSON + HTML files."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from voicemesh.clients import PLAINTEXT, Credentials
from voicemesh.loadtest.capacity import DEFAULT_BUDGET_MS, sweep
from voicemesh.loadtest.driver import loadtest, local_target
from voicemesh.loadtest.options import LoadTestError, LoadTestOptions, check_options
from voicemesh.loadtest.report import format_summary, format_sweep
from voicemesh.mesh import started_local_mesh


def parse_levels(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise LoadTestError(f"--sweep {text!r}: give session counts separated by commas, e.g. 1,2,4,8") from error
    if not levels or min(levels) < 1:
        raise LoadTestError(f"--sweep {text!r}: give session counts of 1 or more, e.g. 1,2,4,8")
    return levels


def parse_think(text: str) -> tuple[float, float]:
    """`--think-s`: one number (always that long) or LOW,HIGH (drawn uniformly, seeded)."""
    try:
        parts = [float(part) for part in text.split(",")]
    except ValueError as error:
        raise LoadTestError(f"--think-s {text!r}: give seconds, e.g. 1.5 or 0.5,3") from error
    if len(parts) not in (1, 2):
        raise LoadTestError(f"--think-s {text!r}: give one number or LOW,HIGH")
    return (parts[0], parts[-1])


def options_from_args(args: argparse.Namespace, credentials: Credentials = PLAINTEXT) -> LoadTestOptions:
    """The flags given; every flag left out keeps `LoadTestOptions`' default."""
    given = {
        "target": args.target,
        "sessions": args.sessions,
        "turns": args.turns,
        "audio": tuple(args.audio),
        "transport": args.transport,
        "ramp_s": args.ramp_s,
        "arrival": args.arrival,
        "pause_s": parse_think(args.think_s) if args.think_s else None,
        "duration_s": args.duration_s,
        "turn_timeout_s": args.turn_timeout_s,
        "allow_remote": args.allow_remote,
        "credentials": credentials,
        "twilio_auth_token": os.environ.get("VOICEMESH_GATEWAY_TWILIO_AUTH_TOKEN"),
    }
    return dataclasses.replace(LoadTestOptions(), **{name: value for name, value in given.items() if value is not None})


async def command(args: argparse.Namespace, credentials: Credentials = PLAINTEXT) -> int:
    """Prints the summary and the report paths; exit 1 when turns failed (or no sweep level fit), 2 when refused.
    An empty `--target` starts a local mesh for the test (after the flags were checked) and stops it after."""
    try:
        options = options_from_args(args, credentials)
        levels = parse_levels(args.sweep) if args.sweep else None
        if options.target:
            return await _run(args, options, levels)
        check_options(dataclasses.replace(options, target="127.0.0.1:1"))  # bad flags: refused before the mesh
        print("starting a local mesh for the test (ASR, LLM, TTS, gateway)...", file=sys.stderr, flush=True)
        async with started_local_mesh("voicemesh-loadtest-", door=options.transport) as target:
            return await _run(args, local_target(options, target), levels)
    except LoadTestError as error:
        print(f"loadtest: {error}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace, options: LoadTestOptions, levels: list[int] | None) -> int:
    out_dir = Path(args.out or f"loadtest-results/{time.strftime('%Y%m%d-%H%M%S')}")
    if levels:
        budget_ms = DEFAULT_BUDGET_MS if args.budget_ms is None else args.budget_ms
        result = await sweep(options, levels, budget_ms, out_dir, not args.sweep_all)
        print(format_sweep(result))
        return 0 if result.capacity_sessions else 1
    report = await loadtest(options, out_dir)
    print(format_summary(report))
    return 0 if report.turns.ok == report.turns.planned else 1
