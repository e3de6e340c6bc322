"""The soak of `python -m bench chaos`: conversations back to back for a while, the busiest LLM replica SIGTERMed
and restarted halfway; the slopes of RSS and of the event loop's task count over the second half."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.faults import SHORT_REPLY, Conversation, converse, inject, script, start_gateway, victim_of
from voicemesh.audio import Clip
from voicemesh.conversation import ReplyDone
from voicemesh.mesh import Mesh


@dataclass
class SoakReport:
    duration_s: float
    sessions: int
    restarted: str
    turns_attempted: int = 0
    turns_completed: int = 0
    samples: list[dict[str, float]] = field(default_factory=list)
    rss_slope_mb_per_min: float = 0.0
    tasks_slope_per_min: float = 0.0
    errors: list[str] = field(default_factory=list)


async def run_soak(mesh: Mesh, clips: Sequence[Clip], duration_s: float, sessions: int = 4) -> SoakReport:
    """Conversations back to back for `duration_s`; the LLM replica most used is SIGTERMed and restarted halfway.
    RSS (of this process: the gateway and the callers) and the event loop's task count are sampled throughout."""
    server = await start_gateway(mesh)
    target = f"127.0.0.1:{server.port}"
    report = SoakReport(duration_s, sessions, "")
    started = time.monotonic()
    deadline = started + duration_s

    async def caller(index: int) -> None:
        round_ = 0
        while time.monotonic() < deadline - 20:
            conversation = Conversation(index, 3)
            clip = script(clips, 3, index + round_)
            await converse(target, conversation, clip, index * 0.7 if not round_ else 0, SHORT_REPLY)
            done = {e.turn_index for e in conversation.events if isinstance(e, ReplyDone)}
            report.turns_attempted += 3
            report.turns_completed += min(3, len([t for t in conversation.turns if t.turn_index in done]))
            if conversation.error:
                report.errors.append(conversation.error)
            round_ += 1

    async def sample() -> None:
        while True:
            report.samples.append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "rss_mb": round(_rss_mb(), 1),
                    "tasks": len(asyncio.all_tasks()),
                }
            )
            await asyncio.sleep(10)

    async def restart_halfway() -> None:
        await asyncio.sleep(duration_s / 2)
        report.restarted = victim_of(server, "llm", mesh)
        await inject(mesh, report.restarted, "sigterm")

    sampler = asyncio.ensure_future(sample())
    try:
        await asyncio.gather(*(caller(i) for i in range(sessions)), restart_halfway())
    finally:
        sampler.cancel()
        await server.stop()
    # The slope over the second half of the soak (the first holds warm-up: caches, first allocations).
    late = [s for s in report.samples if s["t_s"] >= duration_s / 2]
    if len(late) >= 3:
        times = [s["t_s"] / 60 for s in late]
        report.rss_slope_mb_per_min = round(float(np.polyfit(times, [s["rss_mb"] for s in late], 1)[0]), 3)
        report.tasks_slope_per_min = round(float(np.polyfit(times, [s["tasks"] for s in late], 1)[0]), 3)
    return report


def _rss_mb() -> float:
    try:
        with open(f"/proc/{os.getpid()}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def as_json(report: SoakReport) -> dict[str, Any]:
    return dataclasses.asdict(report)
