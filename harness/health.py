"""Is the mesh well, after a batch of fuzz: every process alive and answering a well-formed call, no session left
open, no error logged, and a calm conversation beside the fuzz going on unharmed (harness/fuzz.py runs these)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import numpy as np
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from harness.clips import SHARED_AUDIO
from voicemesh import clients
from voicemesh.audio import Clip, read_wav
from voicemesh.conversation import SessionError, Started, talk
from voicemesh.serving import health_check
from voicemesh.v1 import llm_pb2

CONTROL_CLIP = SHARED_AUDIO / "spk1_snt1.wav"
CONTROL_TRANSCRIPT = "The child almost hurt the small dog."
REPORTED = 5
"""Problems listed per check (the rest are counted)."""


@dataclass(frozen=True)
class Targets:
    """Where the doors are, and how to see that the processes behind them are well."""

    gateway: str
    asr: str
    llm: str
    tts: str
    http: str = ""
    """Base URL of the gateway's browser doors ("" = they are not fuzzed)."""
    metrics: str = ""
    """The gateway's /metrics URL: its open sessions (the leak check) and INTERNAL errors ("" = not checked)."""
    processes: Mapping[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    """The processes that must stay alive."""
    logs: Mapping[str, str] = field(default_factory=dict)
    """Their log files (JSON lines): an error logged is a crash the client never saw."""


class ControlSession:
    """A calm conversation beside the fuzzing: a real speech clip spoken to the gateway, again and again. Each
    conversation must hear the clip's words, reply in text and audio, and report no error."""

    def __init__(self, target: str, clip: Clip, transcript: str) -> None:
        self.target = target
        self.clip = clip
        self.words = set(_words(transcript))
        self.conversations = 0
        self.failures: list[str] = []
        self.open_sessions = 0
        """Sessions it has open on the gateway now (0 or 1), which the leak check allows for."""

    async def run(self, stop: asyncio.Event) -> None:
        """Converse until `stop` is set (the conversation under way is finished)."""
        while not stop.is_set():
            self.open_sessions = 1
            try:
                turns, audio, events = await asyncio.wait_for(
                    talk(self.target, self.clip, trailing_silence_s=2.0), self.clip.duration_s + 90
                )
                problem = self._problem(turns, audio, events)
            except Exception as error:  # a failed conversation is a finding, reported with the others
                problem = f"{type(error).__name__}: {error}"[:300]
            finally:
                self.open_sessions = 0
            self.conversations += 1
            if problem:
                self.failures.append(f"conversation {self.conversations}: {problem}")

    def _problem(self, turns: list[Any], audio: bytes, events: list[Any]) -> str:
        # The words may come in more than one turn: under CPU load a pause's completeness score can be late, and the
        # fixed hangover then ends the turn at the pause (that is the endpointing's design, not a fault).
        errors = [event for event in events if isinstance(event, SessionError)]
        if errors:
            return f"error event {errors[0]}"
        heard = " ".join(turn.user_text for turn in turns)
        if len(self.words & set(_words(heard))) < 0.7 * len(self.words):
            return f"heard {heard!r}"
        if not any(turn.reply_text.strip() for turn in turns) or not audio:
            return f"no reply ({len(audio)} bytes of audio)"
        return ""

    def summary(self) -> dict[str, Any]:
        return {
            "conversations": self.conversations,
            "ok": self.conversations - len(self.failures),
            "failures": self.failures[:REPORTED],
        }


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


async def _checked(call: Awaitable[str], limit_s: float = 60.0) -> str:
    """What a well-formed call came to: "ok", or what went wrong."""
    try:
        async with asyncio.timeout(limit_s):
            return await call
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:300]


async def _health(targets: Targets) -> str:
    for target in (targets.gateway, targets.asr, targets.llm, targets.tts):
        async with grpc.aio.insecure_channel(target) as channel:
            reply = await health_check(channel)(health_pb2.HealthCheckRequest(), timeout=5)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return f"{target} is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return "ok"


async def _recognize_silence(target: str) -> str:
    silence = Clip(np.zeros(8000, np.float32), 16000)
    async for _ in clients.recognize(target, silence, realtime=False, trailing_silence_s=0.2):
        pass
    return "ok"


async def _generate(target: str) -> str:
    responses = [r async for r in clients.generate(target, [(llm_pb2.ROLE_USER, "Say hello.")], max_tokens=4)]
    finished = responses and responses[-1].finish_reason != llm_pb2.FINISH_REASON_UNSPECIFIED
    return "ok" if finished else f"no finish_reason in {len(responses)} responses"


async def _synthesize(target: str) -> str:
    kinds = [event.WhichOneof("event") async for _, event in clients.synthesize(target, ["Hello."], rate_hz=16000)]
    return "ok" if "audio" in kinds and kinds[-1] == "done" else f"got {kinds[-3:]}"


async def _converse(target: str) -> str:
    _, _, events = await talk(target, Clip(np.zeros(4800, np.float32), 16000), trailing_silence_s=0.2)
    if not any(isinstance(event, Started) for event in events):
        return "no SessionStarted"
    errors = [event for event in events if isinstance(event, SessionError)]
    return f"error event {errors[0]}" if errors else "ok"


async def _page_config(base_url: str) -> str:
    async with aiohttp.ClientSession() as client, client.get(f"{base_url}/api/config") as reply:
        return "ok" if reply.status == 200 else f"HTTP {reply.status}"


async def _metrics(url: str) -> dict[str, float]:
    """The gateway's open sessions and INTERNAL errors so far, from its /metrics."""
    async with aiohttp.ClientSession() as client, client.get(url) as reply:
        text = await reply.text()
    values = {"sessions": 0.0, "internal_errors": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "voicemesh_gateway_active_sessions":
                values["sessions"] = sample.value
            elif sample.name == "voicemesh_errors_total" and sample.labels.get("code") == "INTERNAL":
                values["internal_errors"] += sample.value
    return values


BENIGN_LOG_ERRORS = ("aiohttp.http_exceptions.",)
"""Errors logged for what was the client's fault and answered as such: aiohttp logs a malformed HTTP request (a
header over 8 KB) with its traceback, and answers it 400."""
KNOWN_LOG_ERRORS: dict[str, tuple[str, ...]] = {
    # Errors the fuzz found outside the doors, counted apart until fixed (each entry: what, and the marks of its log
    # line). Empty: both found so far (a merge_reader get() left pending, and the gateway's abandoned request
    # iterators) are fixed.
}
"""Errors the fuzz found whose fix is outside the doors (reported, counted apart; they do not fail a check):
description -> the strings a log line of it holds."""


@dataclass
class LoggedErrors:
    """Error records found in the logs: unknown ones (short lines) and known ones (counts by description)."""

    new: list[str] = field(default_factory=list)
    known: dict[str, int] = field(default_factory=dict)


class LogWatch:
    """New error records in the processes' logs since the last look."""

    def __init__(self, logs: Mapping[str, str]) -> None:
        self._offsets = {name: _size(path) for name, path in logs.items()}
        self._paths = dict(logs)

    def new_errors(self) -> LoggedErrors:
        """The error records (and tracebacks printed outside the logger) written since the last call."""
        found = LoggedErrors()
        for name, path in self._paths.items():
            data = b""
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as log_file:
                log_file.seek(self._offsets[name])
                data = log_file.read()
                self._offsets[name] += len(data)
            for line in data.decode(errors="replace").splitlines():
                error = _error_of(line)
                if not error or any(benign in line for benign in BENIGN_LOG_ERRORS):
                    continue
                known = [what for what, marks in KNOWN_LOG_ERRORS.items() if all(mark in line for mark in marks)]
                if known:
                    found.known[known[0]] = found.known.get(known[0], 0) + 1
                else:
                    found.new.append(f"{name}: {error}"[:300])
        return found


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def _error_of(line: str) -> str:
    """The message and exception of an ERROR or CRITICAL record ("" for any other line)."""
    try:
        record = json.loads(line)
    except ValueError:
        return line.strip() if line.startswith("Traceback") else ""
    if not isinstance(record, dict) or record.get("level") not in ("ERROR", "CRITICAL"):
        return ""
    exception = str(record.get("exc", "")).strip().splitlines()
    return f"{record.get('msg', '')}" + (f" | {exception[-1]}" if exception else "")


async def check_batch(
    after: str,
    targets: Targets,
    control: ControlSession | None = None,
    settle_s: float = 10.0,
    logs: LogWatch | None = None,
) -> dict[str, Any]:
    """After a door's batch: every process alive and answering a well-formed call; with metrics, no session left
    open beyond the control's (waiting `settle_s` for sessions still closing) and no INTERNAL error so far; with
    `logs`, no error logged since the last check but the KNOWN_LOG_ERRORS (counted apart)."""
    dead = [name for name, process in targets.processes.items() if process.poll() is not None]
    calls = {
        "health": await _checked(_health(targets)),
        "asr": await _checked(_recognize_silence(targets.asr)),
        "llm": await _checked(_generate(targets.llm)),
        "tts": await _checked(_synthesize(targets.tts)),
        "converse": await _checked(_converse(targets.gateway)),
    }
    if targets.http:
        calls["config"] = await _checked(_page_config(targets.http))
    result: dict[str, Any] = {"after": after, "dead": dead, "calls": calls}
    if targets.metrics:
        deadline_s = time.monotonic() + settle_s
        while True:
            metrics = await _metrics(targets.metrics)
            leaked = max(0, int(metrics["sessions"]) - (control.open_sessions if control else 0))
            if not leaked or time.monotonic() > deadline_s:
                break
            await asyncio.sleep(0.25)
        result["leaked_sessions"] = leaked
        result["internal_errors"] = int(metrics["internal_errors"])
    if logs is not None:
        errors = logs.new_errors()
        result["logged_errors"] = len(errors.new)
        result["first_logged_errors"] = errors.new[:REPORTED]
        result["known_logged_errors"] = errors.known
    result["ok"] = (
        not dead
        and all(outcome == "ok" for outcome in calls.values())
        and not result.get("leaked_sessions")
        and not result.get("internal_errors")
        and not result.get("logged_errors")
    )
    return result


async def control_clip(tts_target: str) -> Clip:
    """The control's clip: the recording in ../shared/audio, or, in a clone without it, its transcript spoken by the
    mesh's own TTS."""
    if CONTROL_CLIP.exists():
        return read_wav(CONTROL_CLIP)
    pcm = bytearray()
    async for _, event in clients.synthesize(tts_target, [CONTROL_TRANSCRIPT], rate_hz=16000):
        if event.WhichOneof("event") == "audio":
            pcm += event.audio.frame.data
    speech = np.frombuffer(bytes(pcm), "<i2").astype(np.float32) / 32768
    silence = np.zeros(4800, np.float32)
    return Clip(np.concatenate([silence, speech, silence]), 16000)
