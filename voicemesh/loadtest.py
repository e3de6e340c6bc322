"""Load test: N concurrent conversations of real speech against a gateway; V2V percentiles per stage, capacity sweep.

Each session is one Conversation.Converse call that speaks M clips at real-time pace. After each clip it streams
silence until that turn's reply has finished (its TurnMetrics arrives), then a natural pause of 0.5-1.5 s, so the
client never talks over the bot (that would be barge-in). V2V per turn is measured at the client as `talk()`
does: first reply audio received - send time of the clip's last speech frame (by energy). Failures are values:
a turn that does not complete carries the gRPC status name or the session error's `stage:code`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import logging
import os
import platform
import random
import sys
import time
import uuid
import wave
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from voicemesh import loadstats
from voicemesh.audio import FRAME_MS, read_wav
from voicemesh.clients import epoch_us
from voicemesh.conversation import (
    ConversationClient,
    Interrupted,
    ReplyText,
    SessionError,
    TalkTurn,
    TurnMetrics,
    UserTranscript,
    speech_frames,
)
from voicemesh.mesh import DEFAULT_PORTS, local_mesh
from voicemesh.stages import QUEUE_STAGES, STAGE_NAMES
from voicemesh.v1 import conversation_pb2

log = logging.getLogger(__name__)

RATE_HZ = 16000
FRAME_S = FRAME_MS / 1000
SILENCE_FRAME = b"\x00" * (RATE_HZ * FRAME_MS // 1000 * 2)
TAIL_FRAMES = 5  # keep 100 ms after a clip's last speech frame; the harness adds its own pauses
CLOSE_TIMEOUT_S = 5.0
MAX_SESSIONS = 512
MAX_TURNS = 100
DEFAULT_BUDGET_MS = 1500.0
TRANSPORTS = ("grpc", "ws")
OK = "OK"
NOT_STARTED = "NOT_STARTED"


class LoadTestError(Exception):
    """A load test that cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class LoadTestOptions:
    """What one load test does. Defaults live here and nowhere else."""

    target: str = f"127.0.0.1:{DEFAULT_PORTS['gateway']}"
    """Gateway address, HOST:PORT. Empty: `run_loadtest`/`run_sweep` start a local mesh of their own."""
    sessions: int = 2
    """Concurrent conversations (1-512)."""
    turns: int = 2
    """Clips each session speaks, one turn each (1-100)."""
    audio: tuple[str, ...] = ()
    """WAV files or directories of them (every *.wav); sessions cycle through them, each starting elsewhere."""
    transport: str = "grpc"
    """`grpc` (Conversation.Converse) or `ws` (the WebSocket front door, once a client for it exists)."""
    ramp_s: float = 1.0
    """Session starts are spread evenly over this long."""
    duration_s: float = 300.0
    """Hard limit for the whole test; turns still running then fail with DURATION_LIMIT."""
    pause_s: tuple[float, float] = (0.5, 1.5)
    """Natural pause after each reply, drawn uniformly from this range."""
    turn_timeout_s: float = 30.0
    """A turn whose reply has not finished this long after its clip fails with TIMEOUT."""
    allow_remote: bool = False
    """Non-loopback targets are refused unless this is set."""
    seed: int = 0
    """Seed of the pauses, so two runs pause alike."""


@dataclass(frozen=True)
class SpeechClip:
    """One clip as the 20 ms PCM16 frames at 16 kHz a session sends, and which of them hold speech."""

    name: str
    frames: tuple[bytes, ...]
    is_speech: tuple[bool, ...]

    @property
    def duration_s(self) -> float:
        return len(self.frames) * FRAME_S


@dataclass
class TurnResult:
    """One turn of one session: what was measured, or why it failed."""

    session: int
    turn: int
    clip: str
    status: str = NOT_STARTED
    detail: str = ""
    clip_start_us: int = 0
    clip_end_us: int = 0
    speech_end_sent_us: int = 0
    first_audio_received_us: int = 0
    v2v_ms: float | None = None
    server_v2v_ms: float | None = None
    stages_ms: dict[str, float] = field(default_factory=dict)
    user_text: str = ""
    reply_text: str = ""
    interrupted: bool = False
    extra_server_turns: int = 0
    errors: list[str] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def fail(self, status: str, detail: str) -> None:
        if self.done.is_set():
            return
        self.status, self.detail = status, detail
        self.done.set()

    def as_dict(self, origin_us: int) -> dict[str, object]:
        def since_start_s(us: int) -> float | None:
            return round((us - origin_us) / 1e6, 3) if us else None

        return {
            "session": self.session,
            "turn": self.turn,
            "clip": self.clip,
            "status": self.status,
            "ok": self.ok,
            "detail": self.detail,
            "v2v_ms": None if self.v2v_ms is None else round(self.v2v_ms, 1),
            "server_v2v_ms": self.server_v2v_ms,
            "stages_ms": self.stages_ms,
            "clip_start_s": since_start_s(self.clip_start_us),
            "clip_end_s": since_start_s(self.clip_end_us),
            "speech_end_s": since_start_s(self.speech_end_sent_us),
            "first_audio_s": since_start_s(self.first_audio_received_us),
            "user": self.user_text,
            "reply": self.reply_text,
            "interrupted": self.interrupted,
            "extra_server_turns": self.extra_server_turns,
            "errors": self.errors,
        }


def is_loopback(target: str) -> bool:
    """Whether a gRPC target (HOST:PORT, [IPv6]:PORT, unix:PATH) stays on this machine."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_options(options: LoadTestOptions) -> None:
    """Refuse what this harness must not or cannot do, with a message saying what to change."""
    if not 1 <= options.sessions <= MAX_SESSIONS:
        raise LoadTestError(f"sessions={options.sessions}: use 1-{MAX_SESSIONS}")
    if not 1 <= options.turns <= MAX_TURNS:
        raise LoadTestError(f"turns={options.turns}: use 1-{MAX_TURNS}")
    if options.duration_s <= 0 or options.ramp_s < 0 or options.turn_timeout_s <= 0:
        raise LoadTestError("duration_s and turn_timeout_s must be positive, ramp_s zero or more")
    low_s, high_s = options.pause_s
    if not 0 <= low_s <= high_s:
        raise LoadTestError(f"pause_s={options.pause_s}: give (low, high) with 0 <= low <= high")
    if not options.audio:
        raise LoadTestError("no audio: give --audio with a 16-bit WAV file or a directory of them")
    if options.transport not in TRANSPORTS:
        raise LoadTestError(f"transport={options.transport!r}: use one of {', '.join(TRANSPORTS)}")
    if options.transport == "ws":
        # The WebSocket front door is being built in gateway/; a client with ConversationClient's interface
        # (send, close, events() yielding voicemesh.conversation events) plugs in at `_open_client`.
        raise LoadTestError(
            "transport ws is unavailable: voicemesh/ has no WebSocket conversation client yet; use --transport grpc"
        )
    if not options.allow_remote and not is_loopback(options.target):
        raise LoadTestError(
            f"target {options.target} is not a loopback address; load-testing another machine needs --allow-remote"
        )


def load_clips(paths: Sequence[str | Path]) -> list[SpeechClip]:
    """Read WAV files (directories: every *.wav, sorted) as 16 kHz frames, trimming silence after the speech."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.glob("*.wav"))
            if not found:
                raise LoadTestError(f"{path}: a directory with no .wav files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise LoadTestError(f"{path}: no such file or directory")
    clips = []
    for path in files:
        try:
            audio = read_wav(path)
        except (ValueError, EOFError, wave.Error) as error:
            raise LoadTestError(f"{path}: not a readable 16-bit PCM WAV ({error})") from error
        frames = audio.to_rate(RATE_HZ).frames()
        speech = speech_frames(frames) if frames else []
        if not any(speech):
            raise LoadTestError(f"{path}: no speech in it (every frame is below the energy threshold)")
        # A long silent tail would let the gateway answer before the clip is over; the harness pauses itself.
        keep = max(index for index, is_speech in enumerate(speech) if is_speech) + 1 + TAIL_FRAMES
        clips.append(SpeechClip(path.stem, tuple(frames[:keep]), tuple(speech[:keep])))
    return clips


class _Pacer:
    """Real-time pace on an absolute schedule: frame k goes out at start + k * 20 ms, so there is no drift."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.frames = 0

    async def wait(self) -> None:
        delay = self.start + self.frames * FRAME_S - time.monotonic()
        self.frames += 1
        if delay > 0:
            await asyncio.sleep(delay)


class _Session:
    """One conversation: speaks its clips turn by turn, waits out each reply, records each turn's outcome."""

    def __init__(self, index: int, options: LoadTestOptions, plan: list[SpeechClip], run_id: str) -> None:
        self.index = index
        self.options = options
        self.plan = plan
        self.turns = [TurnResult(index, number, clip.name) for number, clip in enumerate(plan)]
        self.session_id = f"loadtest-{run_id}-{index}"
        self.rng = random.Random(options.seed * 1_000_003 + index)
        self.current: TurnResult | None = None
        self.sent: list[tuple[int, bool]] = []  # (send time epoch us, is speech) of the current clip's frames
        self.started_us = 0
        self.ended_us = 0
        self.error = ""
        self._user_text: dict[int, str] = {}
        self._reply_text: dict[int, list[str]] = {}
        self._interrupted: set[int] = set()

    async def run(self) -> None:
        self.started_us = epoch_us()
        try:
            async with self._open_client() as client:
                sender = asyncio.ensure_future(self._send(client))
                receiver = asyncio.ensure_future(self._receive(client))
                try:
                    done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
                    if sender in done:
                        sender.result()
                        client.close()
                        await asyncio.wait({receiver}, timeout=CLOSE_TIMEOUT_S)
                    if receiver.done():
                        receiver.result()  # anything but a gRPC status is a bug: let it surface
                finally:
                    for task in (sender, receiver):
                        task.cancel()
                    await asyncio.gather(sender, receiver, return_exceptions=True)
                    # End the request stream too: after a failed call gRPC's task that reads it would otherwise
                    # wait on it forever and be destroyed, noisily, when the event loop closes.
                    client.close()
                    await asyncio.sleep(0)
        finally:
            self.ended_us = epoch_us()

    def _open_client(self) -> ConversationClient:
        config = conversation_pb2.SessionConfig(
            session_id=self.session_id, input_sample_rate_hz=RATE_HZ, output_sample_rate_hz=RATE_HZ
        )
        # No reconnects: a dropped call is a failure the load test must count, not hide.
        return ConversationClient(self.options.target, config, reconnect_attempts=0)

    def fail_rest(self, status: str, detail: str) -> None:
        """The call is over: every turn not yet finished fails with its status."""
        unfinished = [turn for turn in self.turns if not turn.done.is_set()]
        if unfinished and not self.error:
            self.error = f"{status}: {detail}"
        for turn in unfinished:
            turn.fail(status, detail)

    async def _send(self, client: ConversationClient) -> None:
        pacer = _Pacer()
        for number, (turn, clip) in enumerate(zip(self.turns, self.plan, strict=True)):
            self.current, self.sent = turn, []
            turn.clip_start_us = epoch_us()
            for frame, is_speech in zip(clip.frames, clip.is_speech, strict=True):
                await pacer.wait()
                self.sent.append((epoch_us(), is_speech))
                client.send(frame)
            turn.clip_end_us = epoch_us()
            deadline = time.monotonic() + self.options.turn_timeout_s
            while not turn.done.is_set():  # silence until the reply is over: never talk over the bot
                if time.monotonic() >= deadline:
                    turn.fail("TIMEOUT", f"no end of turn within {self.options.turn_timeout_s:g} s after the clip")
                    break
                await pacer.wait()
                client.send(SILENCE_FRAME)
            if number + 1 < len(self.turns):
                for _ in range(round(self.rng.uniform(*self.options.pause_s) / FRAME_S)):
                    await pacer.wait()
                    client.send(SILENCE_FRAME)

    async def _receive(self, client: ConversationClient) -> None:
        try:
            async for event in client.events():
                if isinstance(event, UserTranscript) and event.final:
                    self._user_text[event.turn_index] = event.text
                elif isinstance(event, ReplyText):
                    self._reply_text.setdefault(event.turn_index, []).append(event.text_delta)
                elif isinstance(event, Interrupted):
                    self._interrupted.add(event.turn_index)
                elif isinstance(event, SessionError):
                    if self.current is not None and not self.current.done.is_set():
                        self.current.errors.append(f"{event.stage}:{event.code}: {event.message}")
                elif isinstance(event, TurnMetrics):
                    self._on_metrics(event)
        except grpc.aio.AioRpcError as error:
            self.fail_rest(error.code().name, error.details() or "")
            return
        self.fail_rest("STREAM_ENDED", "the gateway ended the call before the turn finished")

    def _on_metrics(self, event: TurnMetrics) -> None:
        turn = self.current
        if turn is None or turn.done.is_set():
            return
        if not turn.clip_end_us:
            # The gateway ended a turn inside the clip (a pause long enough to endpoint): not this turn's answer.
            turn.extra_server_turns += 1
            return
        server = event.server
        # End of speech, as talk() finds it: the last frame with speech energy sent no later than where the
        # server's VAD put the end.
        limit_us = server.speech_end_capture_us + FRAME_MS * 1000
        spoken = [sent_us for sent_us, is_speech in self.sent if is_speech and sent_us <= limit_us]
        record = TalkTurn(
            event.turn_index,
            user_text=self._user_text.get(event.turn_index, ""),
            reply_text="".join(self._reply_text.get(event.turn_index, [])),
            interrupted=event.turn_index in self._interrupted,
            speech_end_sent_us=spoken[-1] if spoken else server.speech_end_capture_us,
            first_audio_received_us=event.first_audio_received_us,
            metrics=event,
        )
        row = record.as_dict()
        turn.user_text, turn.reply_text, turn.interrupted = record.user_text, record.reply_text, record.interrupted
        turn.speech_end_sent_us, turn.first_audio_received_us = (
            record.speech_end_sent_us,
            record.first_audio_received_us,
        )
        turn.stages_ms = dict(row["stages_ms"])  # type: ignore[call-overload]
        turn.server_v2v_ms = row["server_v2v_ms"]  # type: ignore[assignment]
        if record.v2v_ms is None:
            status, _, message = (turn.errors[0] if turn.errors else "NO_AUDIO").partition(": ")
            turn.fail(status, message or "the turn ended without reply audio")
            return
        turn.v2v_ms = record.v2v_ms
        turn.status = OK
        turn.done.set()


async def loadtest(options: LoadTestOptions, out_dir: str | Path | None = None) -> dict[str, object]:
    """Run one load test against `options.target`; returns the report (and writes JSON + HTML to `out_dir`)."""
    check_options(options)
    clips = load_clips(options.audio)
    run_id = uuid.uuid4().hex[:8]
    # Session i starts at clip i, so concurrent sessions say different things.
    sessions = [
        _Session(index, options, [clips[(index + number) % len(clips)] for number in range(options.turns)], run_id)
        for index in range(options.sessions)
    ]
    origin_us = epoch_us()
    started = time.monotonic()

    async def start(session: _Session) -> None:
        await asyncio.sleep(options.ramp_s * session.index / options.sessions)
        await session.run()

    tasks = [asyncio.ensure_future(start(session)) for session in sessions]
    _, pending = await asyncio.wait(tasks, timeout=options.duration_s)
    for task in pending:
        task.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    wall_s = time.monotonic() - started
    for session, task, outcome in zip(sessions, tasks, outcomes, strict=True):
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            log.warning("load-test session failed", exc_info=outcome)
            session.fail_rest(type(outcome).__name__, str(outcome))
        for turn in session.turns:
            if turn.clip_start_us and task in pending:
                turn.fail("DURATION_LIMIT", f"still running when the {options.duration_s:g} s limit was reached")
            elif turn.clip_start_us:
                turn.fail("INCOMPLETE", "the session ended before this turn finished")
        if session.started_us and not session.ended_us:
            session.ended_us = epoch_us()
    report = build_report(options, clips, sessions, origin_us, wall_s)
    if out_dir is not None:
        write_report(report, Path(out_dir))
    return report


def build_report(
    options: LoadTestOptions, clips: list[SpeechClip], sessions: list[_Session], origin_us: int, wall_s: float
) -> dict[str, object]:
    """The JSON-serialisable report of one load test."""
    all_turns = [turn for session in sessions for turn in session.turns]
    ok = [turn for turn in all_turns if turn.ok]
    failed = [turn for turn in all_turns if turn.status not in (OK, NOT_STARTED)]
    spans_s = [
        ((session.started_us - origin_us) / 1e6, (session.ended_us - origin_us) / 1e6)
        for session in sessions
        if session.started_us
    ]
    config = dataclasses.asdict(options)
    config["clips"] = [{"name": clip.name, "speech_s": round(clip.duration_s, 2)} for clip in clips]
    return {
        "kind": "voicemesh.loadtest",
        "config": config,
        "started_at_us": origin_us,
        "wall_s": round(wall_s, 2),
        "machine": machine(),
        "turns": {
            "planned": len(all_turns),
            "ok": len(ok),
            "failed": len(failed),
            "not_started": len(all_turns) - len(ok) - len(failed),
            "failed_by_error": dict(Counter(turn.status for turn in failed).most_common()),
        },
        "throughput": {
            "ok_turns_per_min": round(len(ok) / wall_s * 60, 2) if wall_s > 0 else 0.0,
            "sessions_completed": sum(1 for session in sessions if all(turn.ok for turn in session.turns)),
        },
        "percentile_method": "linear interpolation between closest ranks (numpy default, Hyndman-Fan type 7)",
        "v2v_ms": loadstats.summarize([turn.v2v_ms for turn in ok if turn.v2v_ms is not None]),
        "stages_ms": {stage: loadstats.summarize([turn.stages_ms[stage] for turn in ok]) for stage in STAGE_NAMES},
        "live_sessions": [[round(t_s, 3), count] for t_s, count in loadstats.live_sessions(spans_s)],
        "sessions": [
            {
                "session": session.index,
                "session_id": session.session_id,
                "started_s": round((session.started_us - origin_us) / 1e6, 3) if session.started_us else None,
                "ended_s": round((session.ended_us - origin_us) / 1e6, 3) if session.ended_us else None,
                "error": session.error,
            }
            for session in sessions
        ],
        "per_turn": [turn.as_dict(origin_us) for turn in all_turns],
    }


def machine() -> dict[str, object]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}


def write_report(report: dict[str, object], out_dir: Path, stem: str = "loadtest") -> None:
    """Write STEM.json and STEM.html into out_dir; their paths go into report['files']."""
    from voicemesh import report_html

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out_dir / f"{stem}.json", out_dir / f"{stem}.html"
    report["files"] = {"json": str(json_path), "html": str(html_path)}
    render = report_html.render_sweep if report.get("kind") == "voicemesh.sweep" else report_html.render_report
    html_path.write_text(render(report), encoding="utf-8")
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


async def sweep(
    options: LoadTestOptions,
    levels: Sequence[int],
    budget_ms: float = DEFAULT_BUDGET_MS,
    out_dir: str | Path | None = None,
    stop_over_budget: bool = True,
    queue_threshold_ms: float = 25.0,
) -> dict[str, object]:
    """Load tests at rising session counts: the largest within `budget_ms` of p99 V2V, and which queue grew first.

    A level is within budget when every turn succeeded and its p99 V2V is at most `budget_ms`. With
    `stop_over_budget`, the sweep ends at the first level over it (higher ones would only overload further).
    """
    ordered = sorted(set(levels))
    if not ordered or ordered[0] < 1:
        raise LoadTestError(f"sweep levels {list(levels)}: give session counts of 1 or more, e.g. 1,2,4,8")
    check_options(dataclasses.replace(options, sessions=ordered[-1]))
    results: list[dict[str, object]] = []
    for sessions in ordered:
        level_dir = None if out_dir is None else Path(out_dir) / f"sessions-{sessions}"
        report = await loadtest(dataclasses.replace(options, sessions=sessions), level_dir)
        v2v: dict[str, float | None] = report["v2v_ms"]  # type: ignore[assignment]
        counts: dict[str, object] = report["turns"]  # type: ignore[assignment]
        stages: dict[str, dict[str, float | None]] = report["stages_ms"]  # type: ignore[assignment]
        within = v2v["p99"] is not None and v2v["p99"] <= budget_ms and counts["failed"] == 0
        results.append(
            {
                "sessions": sessions,
                "within_budget": within,
                "v2v_p50_ms": v2v["p50"],
                "v2v_p95_ms": v2v["p95"],
                "v2v_p99_ms": v2v["p99"],
                "v2v_max_ms": v2v["max"],
                "turns_ok": counts["ok"],
                "turns_failed": counts["failed"],
                "failed_by_error": counts["failed_by_error"],
                "ok_turns_per_min": report["throughput"]["ok_turns_per_min"],  # type: ignore[index]
                "queue_medians_ms": {stage: stages[stage]["p50"] for stage in QUEUE_STAGES},
                "stage_p99_ms": {stage: stages[stage]["p99"] for stage in STAGE_NAMES},
                "report": report.get("files", {}),
            }
        )
        log.info("sweep level done", extra={"sessions": sessions, "v2v_p99_ms": v2v["p99"], "within": within})
        if stop_over_budget and not within:
            break
    best = loadstats.capacity(results)
    growth = loadstats.queue_growth(results, queue_threshold_ms)
    result: dict[str, object] = {
        "kind": "voicemesh.sweep",
        "target": options.target,
        "transport": options.transport,
        "turns_per_session": options.turns,
        "budget_ms": budget_ms,
        "levels_requested": ordered,
        "levels": results,
        "capacity_sessions": best,
        "first_queue_to_grow": growth,
        "machine": machine(),
        "verdict": _verdict(results, best, budget_ms, growth),
    }
    if out_dir is not None:
        write_report(result, Path(out_dir), stem="sweep")
    return result


def _verdict(levels: list[dict[str, object]], best: int, budget_ms: float, growth: dict[str, object]) -> str:
    if best:
        at_best = next(level for level in levels if level["sessions"] == best)
        text = (
            f"{best} session(s) within budget: p99 V2V {at_best['v2v_p99_ms']} ms <= {budget_ms:g} ms on this machine"
        )
    else:
        text = f"no level within budget (p99 V2V <= {budget_ms:g} ms, no failed turns) on this machine"
    if growth["stage"]:
        text += (
            f"; {growth['stage']} grew first: +{growth['grew_ms']} ms median at {growth['at_sessions']} sessions"
            f" vs {growth['baseline_sessions']}"
        )
    elif len(levels) > 1:
        text += f"; no queue median grew by more than {growth['threshold_ms']:g} ms"
    return text


def format_summary(report: dict[str, object]) -> str:
    """The summary table a person reads in a terminal."""
    config: dict[str, object] = report["config"]  # type: ignore[assignment]
    counts: dict[str, object] = report["turns"]  # type: ignore[assignment]
    v2v: dict[str, object] = report["v2v_ms"]  # type: ignore[assignment]
    stages: dict[str, dict[str, object]] = report["stages_ms"]  # type: ignore[assignment]
    lines = [
        f"loadtest {config['target']} ({config['transport']}): {config['sessions']} sessions x {config['turns']} turns,"
        f" ramp {config['ramp_s']:g} s, wall {report['wall_s']} s",
        f"turns: {counts['ok']} ok, {counts['failed']} failed, {counts['not_started']} not started"
        f" of {counts['planned']}; throughput {report['throughput']['ok_turns_per_min']} ok turns/min",  # type: ignore[index]
        "",
        f"{'ms (n=' + str(v2v['count']) + ')':<20}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}",
    ]

    def row(name: str, summary: dict[str, object]) -> str:
        cells = "".join(
            f"{'-' if summary[key] is None else format(summary[key], '.1f'):>9}" for key in ("p50", "p95", "p99", "max")
        )
        return f"{name:<20}{cells}"

    lines.append(row("V2V", v2v))
    lines += [row(f"  {stage}", stages[stage]) for stage in STAGE_NAMES]
    failures: dict[str, int] = counts["failed_by_error"]  # type: ignore[assignment]
    if failures:
        lines += ["", "failed by error: " + ", ".join(f"{status} x{count}" for status, count in failures.items())]
        details = {turn["status"]: turn["detail"] for turn in report["per_turn"] if not turn["ok"]}  # type: ignore[attr-defined, index]
        lines += [f"  {status}: {detail}" for status, detail in details.items() if detail and status != NOT_STARTED]
    files: dict[str, str] = report.get("files", {})  # type: ignore[assignment]
    if files:
        lines += ["", f"json  {files['json']}", f"html  {files['html']}"]
    return "\n".join(lines)


def format_sweep(result: dict[str, object]) -> str:
    """The sweep's table and verdict for a terminal."""
    lines = [
        f"sweep {result['target']} ({result['transport']}): levels {result['levels_requested']},"
        f" {result['turns_per_session']} turns each, budget p99 V2V <= {result['budget_ms']:g} ms",
        "",
        f"{'sessions':>8}{'ok':>6}{'failed':>8}{'p50 ms':>10}{'p99 ms':>10}  within  queue medians ms",
    ]
    for level in result["levels"]:  # type: ignore[attr-defined]
        queues = ", ".join(f"{k} {'-' if v is None else v}" for k, v in level["queue_medians_ms"].items())
        p50, p99 = level["v2v_p50_ms"], level["v2v_p99_ms"]
        lines.append(
            f"{level['sessions']:>8}{level['turns_ok']:>6}{level['turns_failed']:>8}"
            f"{'-' if p50 is None else p50:>10}{'-' if p99 is None else p99:>10}"
            f"  {'yes' if level['within_budget'] else 'no':<6}  {queues}"
        )
    lines += ["", result["verdict"]]  # type: ignore[list-item]
    files: dict[str, str] = result.get("files", {})  # type: ignore[assignment]
    if files:
        lines += [f"json  {files['json']}", f"html  {files['html']}"]
    return "\n".join(lines)


# ---- entry points for the CLI and `make bench` ---------------------------------------------------------------


def run_loadtest(options: LoadTestOptions, out_dir: str | Path | None = None) -> dict[str, object]:
    """`loadtest` from synchronous code; an empty `options.target` starts (and stops) a local mesh for it."""
    if options.target:
        return asyncio.run(loadtest(options, out_dir))
    with local_mesh("voicemesh-loadtest-") as target:
        return asyncio.run(loadtest(dataclasses.replace(options, target=target), out_dir))


def run_sweep(
    options: LoadTestOptions,
    levels: Sequence[int] = (1, 2, 4, 8),
    budget_ms: float = DEFAULT_BUDGET_MS,
    out_dir: str | Path | None = None,
    stop_over_budget: bool = True,
) -> dict[str, object]:
    """`sweep` from synchronous code; an empty `options.target` starts (and stops) a local mesh for it."""
    if options.target:
        return asyncio.run(sweep(options, levels, budget_ms, out_dir, stop_over_budget))
    with local_mesh("voicemesh-loadtest-") as target:
        return asyncio.run(
            sweep(dataclasses.replace(options, target=target), levels, budget_ms, out_dir, stop_over_budget)
        )


def parse_levels(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise LoadTestError(f"--sweep {text!r}: give session counts separated by commas, e.g. 1,2,4,8") from error
    if not levels or min(levels) < 1:
        raise LoadTestError(f"--sweep {text!r}: give session counts of 1 or more, e.g. 1,2,4,8")
    return levels


async def command(args: argparse.Namespace) -> int:
    """`voicemesh loadtest`: prints the summary and the report paths; exit 1 when turns failed, 2 when refused."""
    out_dir = Path(args.out or f"loadtest-results/{time.strftime('%Y%m%d-%H%M%S')}")
    options = LoadTestOptions(
        target=args.target,
        sessions=args.sessions,
        turns=args.turns,
        audio=tuple(args.audio),
        transport=args.transport,
        ramp_s=args.ramp_s,
        duration_s=args.duration_s,
        turn_timeout_s=args.turn_timeout_s,
        allow_remote=args.allow_remote,
    )
    try:
        if args.sweep:
            result = await sweep(
                options, parse_levels(args.sweep), args.budget_ms, out_dir, stop_over_budget=not args.sweep_all
            )
            print(format_sweep(result))
            return 0 if result["capacity_sessions"] else 1
        report = await loadtest(options, out_dir)
    except LoadTestError as error:
        print(f"loadtest: {error}", file=sys.stderr)
        return 2
    print(format_summary(report))
    counts: dict[str, int] = report["turns"]  # type: ignore[assignment]
    return 0 if counts["ok"] == counts["planned"] else 1
