"""Fuzz every door of the mesh with hypothesis and report per-door figures (`python -m bench fuzz`,
tests/integration/test_fuzz.py).

For each door (gateway Converse; the ASR, LLM and TTS services called directly; /api/ws, /api/offer, /api/config):
how many cases it accepted, refused cleanly, crashed on or hung on, the first few bad ones shrunk by hypothesis to a
minimal case; and after each door the checks of harness/health.py (processes well, no session leaked, no error
logged, the calm conversation beside the fuzz unharmed). `run_fuzz` works over a Mesh of services (it starts a
gateway of its own over them) or over given Targets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import os
import subprocess
import tempfile
import time
import warnings
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, seed, settings
from hypothesis.errors import HypothesisWarning

from harness import strategies
from harness.doors import DOORS, Door, Limits, Outcome, Verdict, build_doors
from harness.health import CONTROL_TRANSCRIPT, ControlSession, LogWatch, Targets, check_batch, control_clip
from voicemesh.mesh import STAGES, Mesh, free_port

IDLE_TIMEOUT_S = 5.0
"""The fuzz gateway's idle timeout: a WebRTC offer it accepts is never connected, and its session closes after this
(instead of the default minute)."""
SHRUNK_PER_DOOR = 3
"""Bad outcomes per door that hypothesis shrinks to a minimal case; later ones are reported as they came."""
SHRINK_RUNS = 20
"""New cases one shrink may send to the door (each is a real call, a hang costs hang_s)."""
REPORTED_PER_DOOR = 5


@dataclass
class Figures:
    """One door's figures: how many cases, and how the door answered them."""

    door: str
    cases: int = 0
    clean_errors: int = 0
    accepted: int = 0
    crashes: int = 0
    hangs: int = 0
    unexpected_cases: int = 0
    unexpected: list[str] = field(default_factory=list)
    """Short descriptions of the first few crashes, hangs and unexpected answers, with their (shrunk) cases."""
    seconds: float = 0.0

    def count(self, outcome: Outcome) -> None:
        self.cases += 1
        if outcome.verdict == Verdict.ACCEPTED:
            self.accepted += 1
        elif outcome.verdict == Verdict.CLEAN_ERROR:
            self.clean_errors += 1
        elif outcome.verdict == Verdict.CRASH:
            self.crashes += 1
        elif outcome.verdict == Verdict.HANG:
            self.hangs += 1
        else:
            self.unexpected_cases += 1

    def note(self, text: str) -> None:
        if len(self.unexpected) < REPORTED_PER_DOOR:
            self.unexpected.append(text[:400])

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 1)}


class BadOutcome(Exception):
    """Raised in the hypothesis test on a bad outcome, so that hypothesis shrinks the case."""


@dataclass
class _Round:
    """One hypothesis run over a door: its cases' outcomes, and the failure being shrunk, if any."""

    outcomes: dict[bytes, Outcome] = field(default_factory=dict)
    failure: Outcome | None = None
    minimal: Any = None
    shrink_runs: int = 0


def describe(case: Any) -> str:
    return case.describe() if hasattr(case, "describe") else strategies.short(case, 60)


def fingerprint(value: Any) -> bytes:
    """A digest of a case, equal for equal cases (what hypothesis replays while shrinking is not sent twice)."""
    digest = hashlib.blake2b(digest_size=16)

    def feed(item: Any) -> None:
        if isinstance(item, Message):
            digest.update(type(item).__name__.encode() + item.SerializeToString(deterministic=True))
        elif isinstance(item, bytes):
            digest.update(b"b%d:" % len(item) + item)
        elif isinstance(item, list | tuple):
            digest.update(b"[%d" % len(item))
            for element in item:
                feed(element)
        elif dataclasses.is_dataclass(item):
            feed([getattr(item, f.name) for f in dataclasses.fields(item)])
        else:
            digest.update(repr(item).encode())

    feed(value)
    return digest.digest()


def run_case(door: Door, case: Any, loop: asyncio.AbstractEventLoop, limits: Limits) -> Outcome:
    """Send one case on the event loop (from hypothesis's thread) and wait for the door's answer."""
    future = asyncio.run_coroutine_threadsafe(door.run(case), loop)
    try:
        return future.result(timeout=3 * limits.hang_s + limits.work_s + 30)
    except concurrent.futures.TimeoutError:
        future.cancel()
        return Outcome(Verdict.HANG, "the case did not finish")
    except Exception as error:  # the fuzzer's own client failed: a bug here, reported as such
        return Outcome(Verdict.UNEXPECTED, f"the fuzz client failed: {type(error).__name__}: {error}")


def _hypothesis_test(
    door: Door,
    loop: asyncio.AbstractEventLoop,
    figures: Figures,
    state: _Round,
    examples: int,
    seed_value: int,
    shrink: bool,
    limits: Limits,
) -> Any:
    """A @given test that sends `examples` cases to the door and counts them in `figures`. With `shrink`, the first
    bad outcome fails the test, hypothesis shrinks its case (cases it has seen answered from memory, at most
    SHRINK_RUNS new ones sent), and `state.minimal` is the smallest case that still gets the same verdict."""

    @seed(seed_value)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,  # the seed above makes each run the same
        phases=(Phase.generate, Phase.shrink),
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    @given(door.cases())
    def test(case: Any) -> None:
        key = fingerprint(case)
        shrinking = state.failure is not None
        outcome = state.outcomes.get(key) if shrinking else None
        if outcome is None:
            if shrinking and state.shrink_runs >= SHRINK_RUNS:
                reject()
            state.shrink_runs += shrinking
            outcome = state.outcomes[key] = run_case(door, case, loop, limits)
        if not shrinking:
            figures.count(outcome)
            if outcome.bad and shrink:
                state.failure = outcome
            elif outcome.bad:
                figures.note(f"{outcome.verdict.value}: {outcome.detail} <- {describe(case)}")
        # One place raises, so that hypothesis sees one failure however it is reached.
        if state.failure is not None and outcome.verdict == state.failure.verdict:
            state.minimal = case
            raise BadOutcome(outcome.detail)

    return test


def explore(door: Door, loop: asyncio.AbstractEventLoop, examples: int, seed_value: int, limits: Limits) -> Figures:
    """Fuzz one door with `examples` cases (run in a thread; the cases go to `loop`)."""
    # Hypothesis writes out the minimal case of a failure; megabytes of frame data make that slow, not wrong.
    warnings.filterwarnings("ignore", "Generating overly large repr", HypothesisWarning)
    figures = Figures(door.name)
    started_s = time.monotonic()
    shrinks_left = SHRUNK_PER_DOOR
    for round_index in range(examples):
        state = _Round()
        remaining = examples - figures.cases
        test = _hypothesis_test(
            door, loop, figures, state, remaining, seed_value + round_index, shrinks_left > 0, limits
        )
        try:
            test()
        except BadOutcome:
            pass
        except Exception as error:  # hypothesis itself gave up (e.g. Flaky): say so, keep the figures
            figures.note(f"hypothesis stopped: {type(error).__name__}: {error}")
        if state.failure is not None:
            shrinks_left -= 1
            figures.note(_shrunk_note(state))
        if state.failure is None or figures.cases >= examples:
            break
    figures.seconds = time.monotonic() - started_s
    return figures


def _shrunk_note(state: _Round) -> str:
    assert state.failure is not None
    minimal = state.outcomes.get(fingerprint(state.minimal), state.failure)
    return f"{minimal.verdict.value}: {minimal.detail} <- shrunk to {describe(state.minimal)}"


async def fuzz_door(door: Door, examples: int, seed_value: int = 0, limits: Limits | None = None) -> Figures:
    """Fuzz one door with `examples` cases; the same seed sends the same cases."""
    loop = asyncio.get_running_loop()
    seed_value += zlib.crc32(door.name.encode())  # each door its own sequence
    return await asyncio.to_thread(explore, door, loop, examples, seed_value, limits or Limits())


# ---- the mesh under fuzz ------------------------------------------------------------------------------------------
def stage_targets(mesh: Mesh) -> dict[str, list[str]]:
    """Each stage's replicas in a mesh of services (processes named asr, llm, tts, or asr-a, asr-b, ...)."""
    replicas = {
        stage: [p.target for name, p in mesh.processes.items() if name.split("-")[0] == stage] for stage in STAGES
    }
    if missing := [stage for stage, targets in replicas.items() if not targets]:
        raise ValueError(f"the mesh has no {', '.join(missing)} process to fuzz")
    return replicas


@contextlib.asynccontextmanager
async def fuzz_gateway(
    services: Mesh | Mapping[str, str], idle_timeout_s: float = IDLE_TIMEOUT_S
) -> AsyncIterator[Targets]:
    """A gateway process of the fuzzer's own over `services` (a Mesh of ASR, LLM and TTS processes, or stage ->
    target), with its browser doors, /metrics and a log; yields the Targets: it, and the first replica of each stage
    for the direct calls. Its per-client limit on session starts is off (the fuzzer alone starts hundreds a minute)."""
    processes: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, str] = {}
    if isinstance(services, Mesh):
        replicas = stage_targets(services)
        for name, process in services.processes.items():
            if name.split("-")[0] in STAGES:
                processes[name] = process.popen
                if services.log_dir:
                    logs[name] = os.path.join(services.log_dir, f"{name}.log")
    else:
        replicas = {stage: services[stage].split(",") for stage in STAGES}
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix="voicemesh-fuzz-gateway-"))
    http_port, metrics_port = free_port(), free_port()
    args = [f"--{stage}-target={','.join(replicas[stage])}" for stage in STAGES]
    args += [f"--http-port={http_port}", f"--metrics-port={metrics_port}", f"--idle-timeout-s={idle_timeout_s:g}"]
    gateway = mesh.start("gateway", free_port(), [*args, "--session-starts-per-minute=0"])
    try:
        await mesh.wait(timeout_s=120)
        yield Targets(
            gateway=gateway.target,
            asr=replicas["asr"][0],
            llm=replicas["llm"][0],
            tts=replicas["tts"][0],
            http=f"http://127.0.0.1:{http_port}",
            metrics=f"http://127.0.0.1:{metrics_port}/metrics",
            processes={**processes, "gateway": gateway.popen},
            logs={**logs, "gateway": os.path.join(mesh.log_dir or "", "gateway.log")},
        )
    finally:
        await asyncio.to_thread(mesh.stop_all)


async def browser_offer() -> str:
    """A real offer, as a page makes it: an audio transceiver and the events data channel (no STUN)."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    peer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        peer.addTransceiver("audio", direction="sendrecv")
        peer.createDataChannel("events")
        await peer.setLocalDescription(await peer.createOffer())
        return str(peer.localDescription.sdp)
    finally:
        await peer.close()


@contextlib.asynccontextmanager
async def open_doors(targets: Targets, limits: Limits) -> AsyncIterator[dict[str, Door]]:
    """The doors of `targets`, on channels open for the duration."""
    names = {"gateway": targets.gateway, "asr": targets.asr, "llm": targets.llm, "tts": targets.tts}
    channels = {name: grpc.aio.insecure_channel(target) for name, target in names.items()}
    try:
        offer = await browser_offer() if targets.http else ""
        yield build_doors(channels, targets.http, offer, limits)
    finally:
        for channel in channels.values():
            await channel.close()


async def run_fuzz(
    targets: Targets | Mesh,
    examples: int = 200,
    doors: Sequence[str] = DOORS,
    seed_value: int = 0,
    limits: Limits | None = None,
    control: ControlSession | bool = True,
    settle_s: float = IDLE_TIMEOUT_S + 5,
) -> dict[str, Any]:
    """Fuzz each of `doors` with `examples` cases, checking the mesh after each; returns the report (per-door
    figures, the checks, the control's conversations).

    `targets`: doors to fuzz, or a Mesh of services, over which a gateway of the fuzzer's own is started
    (`fuzz_gateway`). `control`: the calm conversation beside the fuzz (True: the default clip; False: none)."""
    if isinstance(targets, Mesh):
        async with fuzz_gateway(targets) as fuzzed:
            return await run_fuzz(fuzzed, examples, doors, seed_value, limits, control, settle_s)
    limits = limits or Limits()
    started_s = time.monotonic()
    if control is True:
        control = ControlSession(targets.gateway, await control_clip(targets.tts), CONTROL_TRANSCRIPT)
    beside = control or None
    stop = asyncio.Event()
    conversing = asyncio.ensure_future(beside.run(stop)) if beside is not None else None
    figures: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    logs = LogWatch(targets.logs)
    try:
        async with open_doors(targets, limits) as available:
            for name in doors:
                if name not in available:
                    raise ValueError(f"door {name!r} unknown or not reachable here; doors: {sorted(available)}")
                figures.append((await fuzz_door(available[name], examples, seed_value, limits)).as_dict())
                checks.append(await check_batch(name, targets, beside, settle_s, logs))
    finally:
        stop.set()
        if conversing is not None:
            await conversing
    return {
        "examples_per_door": examples,
        "seed": seed_value,
        "doors": figures,
        "checks": checks,
        "control": beside.summary() if beside is not None else None,
        "seconds": round(time.monotonic() - started_s, 1),
        "logs": sorted({os.path.dirname(path) for path in targets.logs.values()}),
    }
