"""`python -m bench fuzz`: every door of a fresh mesh fuzzed with hypothesis, one JSON document per run.

Starts ASR, LLM and TTS as processes on loopback and fuzzes them and a gateway of the fuzz's own (harness/fuzz.py):
per door, how many cases it accepted, refused cleanly, crashed on or hung on, and the checks after each door.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
from collections.abc import Sequence

from harness.doors import DOORS, Limits
from harness.fuzz import run_fuzz
from voicemesh.mesh import STAGES, Mesh, free_port


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=200, help="cases per door")
    parser.add_argument("--doors", default=",".join(DOORS), help=f"comma-separated, of {','.join(DOORS)}")
    parser.add_argument("--seed", type=int, default=0, help="the same seed sends the same cases")
    parser.add_argument("--hang-s", type=float, default=Limits.hang_s, help="silence that counts as a hang")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix="voicemesh-fuzz-"))
    for stage in STAGES:
        mesh.start(stage, free_port())
    try:
        asyncio.run(mesh.wait(timeout_s=240))
        limits = Limits(hang_s=args.hang_s)
        report = asyncio.run(run_fuzz(mesh, args.examples, args.doors.split(","), args.seed, limits))
        print(json.dumps(report, indent=2))
    finally:
        mesh.stop_all()


if __name__ == "__main__":
    main()
