"""Benchmarks: each prints JSON; `python -m bench` runs them all and writes bench/results/."""

from __future__ import annotations

import json
import sys


def print_result(result: dict[str, object], drop: str | None = None) -> None:
    """A benchmark's result on stdout as indented JSON, without the key `drop` (per-item detail not asked for)."""
    if drop is not None:
        result.pop(drop, None)
    json.dump(result, sys.stdout, indent=2)
    print()
