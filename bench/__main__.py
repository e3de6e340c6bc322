"""The benchmark suite: `python -m bench --list` names each benchmark, `python -m bench NAME [ARGS]` runs one (ARGS go
to its own command line; `python -m bench NAME --help` shows them), and `python -m bench` runs the full set and
writes one JSON file under bench/results/ (`make bench`)."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import runpy
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Benchmark:
    module: str  # run as `python -m MODULE *command ARGS`
    purpose: str
    command: tuple[str, ...] = ()


BENCHMARKS = {
    "services": Benchmark(
        "bench.services",
        "each engine alone: ASR trimmed vs 30 s window, LLM cold vs cached TTFT, TTS words vs sentence",
    ),
    "pipeline": Benchmark(
        "bench.pipeline", "voice-to-voice latency of the whole mesh: naive, sentence and all-on pipelines"
    ),
    "turns": Benchmark("bench.turns", "end of turn: false cut-offs against dead air, fixed and scored hangover"),
    "turn_text": Benchmark(
        "bench.turn_text", "end of turn on text alone: the LLM's P(turn end) word by word, its waits"
    ),
    "turn_fusion": Benchmark(
        "bench.turn_fusion", "end of turn on spoken pauses: each signal alone and fused, cut-offs against dead air"
    ),
    "smart_turn_pause": Benchmark(
        "bench.smart_turn_pause", "Smart Turn's P as a pause goes on: finished against inside at 32-500 ms of silence"
    ),
    "asr_rest": Benchmark(
        "bench.asr_rest", "Whisper's text ending before the speech: decoded once vs the rest decoded and appended"
    ),
    "routing": Benchmark("bench.routing", "LLM routing over two replicas: sticky vs round-robin, admission on vs off"),
    "llm_batch": Benchmark("bench.llm_batch", "llama.cpp replies at once: batched vs slot engine tokens/s and TTFT"),
    "browser": Benchmark("bench.browser", "V2V in a real browser over WebRTC and WebSocket, beside a gRPC client"),
    "phone": Benchmark("bench.phone", "V2V over the phone door (Twilio) beside gRPC; ASR WER on G.711 8 kHz speech"),
    "realtime": Benchmark("bench.realtime", "V2V through the OpenAI Realtime door (/v1/realtime) beside gRPC"),
    "chaos": Benchmark("bench.chaos", "faults under load (SIGKILL/SIGSTOP/SIGTERM of a replica), fuzz and soak"),
    "fuzz": Benchmark(
        "bench.chaos.fuzz", "every door of a fresh mesh fuzzed with hypothesis: refusals, crashes, hangs"
    ),
    "loadtest": Benchmark(
        "voicemesh.cli",
        "concurrent conversations on a mesh: V2V percentiles, capacity (voicemesh loadtest)",
        ("loadtest",),
    ),
}


def list_benchmarks() -> str:
    width = max(len(name) for name in BENCHMARKS)
    lines = [f"{name:<{width}}  {benchmark.purpose}" for name, benchmark in BENCHMARKS.items()]
    return "\n".join(
        [*lines, "", "python -m bench NAME [ARGS]: one of them; python -m bench: the full set (make bench)"]
    )


def run_one(name: str, args: list[str]) -> None:
    """Run benchmark `name` as `python -m MODULE ARGS` would."""
    benchmark = BENCHMARKS[name]
    sys.argv = [f"python -m bench {name}", *benchmark.command, *args]
    runpy.run_module(benchmark.module, run_name="__main__", alter_sys=True)


def run_all() -> None:
    """The full set, one JSON document, also written under bench/results/."""
    from bench import llm_batch, pipeline, routing, services, turns
    from bench.chaos import __main__ as chaos
    from voicemesh import loadtest

    results: dict[str, object] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
        "services": services.run(),
    }
    results["pipeline_v2v"] = pipeline.run()
    end_of_turn = turns.run()
    end_of_turn.pop("per_utterance", None)
    results["end_of_turn"] = end_of_turn
    results["llm_routing"] = routing.run()
    results["llm_batched_decode"] = llm_batch.run()
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


def main(argv: list[str]) -> None:
    if not argv:
        run_all()
    elif argv[0] in ("--list", "-l"):
        print(list_benchmarks())
    elif argv[0] in ("--help", "-h"):
        print(__doc__, "", list_benchmarks(), sep="\n")
    elif argv[0] in BENCHMARKS:
        run_one(argv[0], argv[1:])
    else:
        raise SystemExit(f"no benchmark {argv[0]!r}; one of: {', '.join(BENCHMARKS)} (python -m bench --list)")


if __name__ == "__main__":
    main(sys.argv[1:])
