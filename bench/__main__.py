"""Run every benchmark and write one JSON file under bench/results/ (`make bench`)."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench import asr_batch, asr_urgency, continuation, llm_batch, pipeline, routing, services, turns, vocabulary
from bench.chaos import __main__ as chaos
from voicemesh import loadtest


def main() -> None:
    results: dict[str, object] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
        "services": services.run(),
    }
    results["pipeline_v2v"] = pipeline.run()
    end_of_turn = turns.run()
    end_of_turn.pop("per_utterance", None)
    results["end_of_turn"] = end_of_turn
    continued = continuation.run(list(continuation.DEFAULT_CLIPS))
    continued.pop("per_utterance", None)
    results["continued_turns"] = continued
    results["llm_routing"] = routing.run()
    results["llm_batched_decode"] = llm_batch.run()
    results["llm_vocabulary"] = vocabulary.run()
    results["asr_batched_finals"] = asr_batch.run()
    results["asr_partial_urgency"] = asr_urgency.run()
    audio = Path(__file__).resolve().parents[2] / "shared" / "audio"
    if audio.exists():
        clips = tuple(str(audio / f"{name}.wav") for name in ("spk1_snt1", "spk2_snt1", "wizard", "horizon"))
        options = loadtest.LoadTestOptions(target="", turns=2, audio=clips)
        out = Path(__file__).resolve().parent / "results" / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
        results["loadtest_sweep"] = loadtest.run_sweep(options, (1, 2, 4, 8), out_dir=out).to_json()
    results["chaos"] = asyncio.run(chaos.run(chaos.parse([])))
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    json.dump(results, sys.stdout, indent=2)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
