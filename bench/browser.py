"""Voice-to-voice latency measured in a real browser, over WebRTC and over WebSocket, side by side with a gRPC
client on the same mesh and clips; `python -m bench.browser`.

Debian chromium, driven by playwright, hears a WAV as its microphone (the questions, each followed by silence;
chromium loops the file) and talks to the gateway's page. V2V per turn = first reply audio played by the page -
end of the user's speech as the page's microphone heard it (the end of the clip in the fed WAV; the padding is
digital silence), both on the page's audio clock. The gRPC client (`voicemesh.conversation.talk`, 48 kHz both
ways as the page) speaks the same trimmed clips in real time: V2V = first reply frame received - send of the last
speech frame. Half of its turns run before the browser's, half after.

Prints, as JSON, per transport: V2V p50/p95, the gateway's own V2V, the page's hops (see `measureHops` in
gateway/static/app.js; they add up to the page's V2V), the underrun rate, and against gRPC: the gap in V2V p50, and
how much of it the mesh itself was slower while the browser shared its cores (the gateway hop's p50 less the gRPC
turns' gateway p50): the browser's own CPU, not the path. `remaining_gap_ms` is the gap less that.

`--variant NAME:VOICEMESH_...=V` (twice) runs all of it on a fresh mesh per variant, side by side, for `--rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.variants import environment as variant_environment
from bench.variants import parse_variant
from harness.browser import FED_RATE_HZ, PageDriver, browser_missing, fake_mic_wav, isolate_network, launch, trimmed
from voicemesh.audio import Clip, read_wav
from voicemesh.stages import SERVER_STAGES, server_stages_ms

ROOT = Path(__file__).resolve().parents[1]
CLIPS = ROOT.parent / "shared" / "audio"
STAGE_FIELDS = tuple(f"{name}_ms" for name in SERVER_STAGES)  # the gateway's split of its hop, as TurnMetrics names it


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "p50": round(float(np.percentile(values, 50)), 1),
        "p95": round(float(np.percentile(values, 95)), 1),
        "mean": round(statistics.fmean(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


def renice_browser(nice: int) -> int:
    """Give every thread of this process's chromium descendants nice value `nice`; returns how many it changed.

    A thread inherits its creator's value, so processes and threads started after a sweep mostly come out right;
    a sweep every second catches the rest."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:  # exited meanwhile
                continue
            children.setdefault(parent, []).append(int(entry.name))
    changed, pending = 0, list(children.get(os.getpid(), []))
    while pending:
        pid = pending.pop()
        pending += children.get(pid, [])
        try:
            if "chromium" not in os.readlink(f"/proc/{pid}/exe"):
                continue
            for task in os.listdir(f"/proc/{pid}/task"):
                if os.getpriority(os.PRIO_PROCESS, int(task)) < nice:
                    os.setpriority(os.PRIO_PROCESS, int(task), nice)
                    changed += 1
        except OSError:  # exited meanwhile
            continue
    return changed


async def keep_browser_niced(nice: int) -> None:
    while True:
        renice_browser(nice)
        await asyncio.sleep(1.0)


async def measure(
    url: str, transport: str, wav: Path, turns: int, timeout_s: float, browser_nice: int = 0
) -> dict[str, Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await launch(playwright, wav)
        sweeper = asyncio.create_task(keep_browser_niced(browser_nice)) if browser_nice else None
        try:
            driver = PageDriver(await browser.new_page())
            name, _, query = transport.partition(":")
            await driver.open(f"{url}?transport={name}&max_tokens=20{'&' + query if query else ''}")
            expression = f"Object.values(s.turns).filter((t) => t.v2v_ms > 0).length >= {turns}"
            state = await driver.wait_until(expression, timeout_s)
        finally:
            if sweeper is not None:
                sweeper.cancel()
            await browser.close()
    measured = [t for t in state["turns"].values() if t.get("v2v_ms", 0) > 0][:turns]
    server = [t["metrics"]["v2v_ms"] for t in measured if t.get("metrics")]
    downlink = [
        t["played_ms"] - t["metrics"]["first_audio_sent_us"] / 1000
        for t in measured
        if t.get("metrics") and t["metrics"].get("first_audio_sent_us")
    ]
    stages: dict[str, list[float]] = {}  # the gateway's own split of its hop (TurnMetrics)
    for t in measured:
        for stage in STAGE_FIELDS:
            if stage in (t.get("metrics") or {}):
                stages.setdefault(stage, []).append(t["metrics"][stage])
    hops: dict[str, list[float]] = {}
    for t in measured:
        for hop, value in (t.get("hops") or {}).items():
            hops.setdefault(hop, []).append(value)
    if state["transport"] == "websocket":
        underrun_turns = len({i for i in state["jitter"]["underrunTurns"] if str(i) in state["turns"]})
    else:  # a turn whose receiver had to invent non-silent audio: packets came too late for its jitter buffer
        underrun_turns = sum(1 for t in measured if t.get("rtc_concealed_ms", 0) > 0)
    return {
        "transport": state["transport"],
        "turns": len(measured),
        "v2v_ms": _summary([t["v2v_ms"] for t in measured]),
        "gateway_v2v_ms": _summary(server),
        "downlink_and_buffer_ms": _summary(downlink),
        "hops_p50_ms": {hop: round(float(np.median(values)), 1) for hop, values in hops.items()},
        "gateway_stages_p50_ms": {stage: round(float(np.median(values)), 1) for stage, values in stages.items()},
        "turns_with_hops": min((len(values) for values in hops.values()), default=0),
        "underrun_rate": round(underrun_turns / len(measured), 3) if measured else None,
        "jitter_buffer": state["jitter"],
        "webrtc_jitter_buffer_target_ms": state.get("rtcJitterTargetMs"),  # at the end: raised after late replies
        "webrtc_jitter_buffer_raises": state.get("rtcJitterRaises"),
        "webrtc_jitter_buffer_mean_ms": state.get("rtcJitterBufferMs"),
        "webrtc_output_delay_ms": state.get("rtcOutputDelayMs"),
        "webrtc_concealed_ms": [round(t["rtc_concealed_ms"], 1) for t in measured if "rtc_concealed_ms" in t],
        "user_texts": sorted({t["user_text"] for t in measured}),
    }


async def measure_grpc(target: str, clips: Sequence[Clip], turns: int) -> list[dict[str, float]]:
    """`turns` turns of a gRPC client on the same clips (one session per clip, as `voicemesh talk`)."""
    from voicemesh.conversation import talk
    from voicemesh.v1 import conversation_pb2

    config = conversation_pb2.SessionConfig(
        input_sample_rate_hz=FED_RATE_HZ,
        output_sample_rate_hz=FED_RATE_HZ,
        options=conversation_pb2.PipelineOptions(max_tokens=20),
    )
    measured: list[dict[str, float]] = []
    for index in range(turns):
        said, _, _ = await talk(target, trimmed(clips[index % len(clips)]), config, trailing_silence_s=6.0)
        turn = said[0] if said else None
        if turn is not None and turn.v2v_ms is not None and turn.metrics is not None:
            server = turn.metrics.server
            stages = {f"{name}_ms": value for name, value in server_stages_ms(server).items()}
            measured.append({"v2v_ms": turn.v2v_ms, "gateway_ms": server.v2v_ms, **stages})
    return measured


def compare(browser: dict[str, Any], grpc: list[dict[str, float]]) -> dict[str, Any]:
    """A browser transport against the gRPC turns: the gap in V2V p50 and the part of it that is the mesh running
    slower beside the browser."""
    grpc_v2v = float(np.median([t["v2v_ms"] for t in grpc]))
    grpc_gateway = float(np.median([t["gateway_ms"] for t in grpc]))
    gap = browser["v2v_ms"]["p50"] - grpc_v2v
    gateway_hop = browser["hops_p50_ms"].get("gateway")
    slower = gateway_hop - grpc_gateway if gateway_hop is not None else None
    return {
        "gap_v2v_p50_ms": round(gap, 1),
        "mesh_slower_beside_browser_ms": round(slower, 1) if slower is not None else None,
        "remaining_gap_ms": round(gap - slower, 1) if slower is not None else None,
        "target_gap_ms": 100,
    }


async def run_async(turns: int, transports: list[str], browser_nice: int = 0) -> dict[str, Any]:
    """One fresh local mesh: the gRPC client's turns (half before the browser's, half after) and each transport's;
    with `browser_nice`, chromium runs at that nice value, on what the mesh leaves idle."""
    from voicemesh.mesh import Mesh, free_port

    ports = {name: free_port() for name in ("asr", "llm", "tts", "gateway", "http")}
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix="voicemesh-bench-browser-"))
    mesh.start_local(ports, http_port=ports["http"])  # as `voicemesh up` runs it, on the CPU budget
    workdir = Path(tempfile.mkdtemp(prefix="voicemesh-bench-browser-"))
    questions = [read_wav(CLIPS / f"{name}.wav") for name in ("spk1_snt1", "spk2_snt1", "horizon")]
    parts: list[Clip | float] = [1.0]
    for clip in questions:
        parts += [clip, 9.0]
    wav = workdir / "questions.wav"
    fake_mic_wav(wav, parts)
    results: dict[str, Any] = {}
    grpc: list[dict[str, float]] = []
    target = f"127.0.0.1:{ports['gateway']}"
    try:
        await mesh.wait(timeout_s=240)
        url = f"http://localhost:{ports['http']}/"
        grpc += await measure_grpc(target, questions, turns // 2)
        for transport in transports:
            results[transport] = await measure(url, transport, wav, turns, 60 + turns * 15, browser_nice)
        grpc += await measure_grpc(target, questions, turns - turns // 2)
    finally:
        mesh.stop_all()
    if grpc:
        results["grpc"] = {
            "turns": len(grpc),
            "v2v_ms": _summary([t["v2v_ms"] for t in grpc]),
            "gateway_v2v_ms": _summary([t["gateway_ms"] for t in grpc]),
            "gateway_stages_p50_ms": {
                stage: round(float(np.median([t[stage] for t in grpc])), 1) for stage in STAGE_FIELDS
            },
        }
        for transport in transports:
            results[transport]["against_grpc"] = compare(results[transport], grpc)
    return results


def run(turns: int = 10, transports: Sequence[str] = ("webrtc", "websocket"), browser_nice: int = 0) -> dict[str, Any]:
    return asyncio.run(run_async(turns, list(transports), browser_nice))


def run_variants(
    turns: int, transports: Sequence[str], variants: dict[str, dict[str, str]], rounds: int, browser_nice: int = 0
) -> dict[str, Any]:
    """Each variant on a fresh mesh of its own, per round (the variants take turns going first); per transport the
    medians pooled over the rounds, and the second variant's V2V p50 less the first's."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for round_index in range(rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        for name in order:
            with variant_environment(variants[name]):
                runs[name].append(run(turns, transports, browser_nice))
            print(f"round {round_index + 1}: {name} done", file=sys.stderr)
    results: dict[str, Any] = {"variants": variants, "runs": runs, "v2v_p50_ms": {}}
    for name, measured in runs.items():
        results["v2v_p50_ms"][name] = {
            transport: round(float(np.median([r[transport]["v2v_ms"]["p50"] for r in measured if r.get(transport)])), 1)
            for transport in [*transports, "grpc"]
        }
    if len(variants) >= 2:
        first, second = list(variants)[:2]
        results["second_less_first_v2v_p50_ms"] = {
            transport: round(results["v2v_p50_ms"][second][transport] - results["v2v_p50_ms"][first][transport], 1)
            for transport in [*transports, "grpc"]
        }
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.browser", description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10, help="turns measured per transport (default 10)")
    parser.add_argument(
        "--transports",
        default="webrtc,websocket",
        help="comma-separated (default both); a page option may follow a colon, e.g. websocket:jitter_ms=160",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:VOICEMESH_X=V,...",
        help="run the whole benchmark on a mesh with this environment; give two to compare them side by side, e.g. "
        "--variant asis:VOICEMESH_TTS_TRIM_LEAD_IN=false --variant trimmed:VOICEMESH_TTS_TRIM_LEAD_IN=true",
    )
    parser.add_argument("--rounds", type=int, default=1, help="with --variant: fresh meshes per variant (default 1)")
    parser.add_argument(
        "--browser-nice",
        type=int,
        default=0,
        choices=range(20),
        metavar="0-19",
        help="run chromium at this nice value, so it takes only the CPU the mesh leaves: the mesh as it runs when "
        "the browser is on another machine (default 0: they share the cores alike)",
    )
    args = parser.parse_args(argv)
    reason = browser_missing()
    if reason:
        raise SystemExit(reason)
    isolated = isolate_network()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    transports = args.transports.split(",")
    if args.variant:
        variants = dict(parse_variant(text) for text in args.variant)
        results = run_variants(args.turns, transports, variants, args.rounds, args.browser_nice)
    else:
        results = run(args.turns, transports, args.browser_nice)
    output = {
        "started": started,
        "method": "first reply audio played in chromium - end of the fed WAV's speech, on the page's audio clock",
        "network": "loopback-only namespace" if isolated else "host loopback",
        "browser_nice": args.browser_nice,
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "results": results,
    }
    json.dump(output, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
