"""Process faults under load: two real replicas per stage, a few conversations talking, and one replica SIGKILLed,
SIGSTOPped or SIGTERMed mid-conversation (`python -m bench chaos` and tests/integration/test_chaos.py, test_failover.py).

Each conversation speaks its utterances in real time with pauses between them (`voicemesh.conversation.talk`), to a
gateway in this process (so its sessions can be accounted for: every frame the ASR acknowledged, every reply frame
numbered). Figures per fault:
- turns attempted (utterances spoken), completed (replied to the end) and lost;
- reply frames received and lost (gaps in a turn's numbering), input frames the ASR never acknowledged;
- recovery: for each conversation, from the fault (or the end of the user's speech, if later) to the next reply
  audio it heard; and that less the conversations' V2V p50 before the fault (what the fault itself cost, apart
  from the load: on a 2-core box four conversations take ~2 s of V2V with no fault at all);
- for each reply under way when the fault struck, the longest silence inside it (frames arrive every 20 ms; the
  client's buffer holds 100 ms), since for those the next audio heard comes from what was buffered;
- V2V p50/p99 of turns before, during (the 10 s after) and after the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import signal
import tempfile
import time
import weakref
from collections.abc import AsyncIterable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import numpy as np

from gateway.links import AsrLink, TtsLink
from gateway.server import GatewayServer, GatewaySettings, build_server
from gateway.session import Session
from gateway.streams import ReconnectingStream
from voicemesh.audio import Clip
from voicemesh.clients import epoch_us
from voicemesh.conversation import Event, ReplyAudio, ReplyDone, SessionError, TalkTurn, talk
from voicemesh.cpus import available_cpus, budget_env
from voicemesh.mesh import Mesh, free_port
from voicemesh.v1 import conversation_pb2

log = logging.getLogger(__name__)

STAGES = ("asr", "llm", "tts")
KINDS = ("sigkill", "sigstop", "sigterm")
DURING_S = 10.0  # turns whose speech ended this soon after a fault count as "during" it
FAULT_HOLD_S = 5.0  # a killed or stopped replica comes back (restarted, continued) after this long
GAP_S = 6.0  # silence between a conversation's utterances: a reply (at most SHORT_REPLY) ends before the next
DEFAULT_CLIPS = ("spk2_snt1", "horizon", "spk1_snt1")
QUICK_FAULTS = [("asr", "sigkill"), ("llm", "sigstop"), ("tts", "sigterm")]  # one a stage: what `make test` runs
SHORT_REPLY = conversation_pb2.SessionConfig(options=conversation_pb2.PipelineOptions(max_tokens=24))
SHORT_REPLY_AFTER_COMMIT = conversation_pb2.SessionConfig(
    options=conversation_pb2.PipelineOptions(max_tokens=24, speculative_start=False)
)
"""For a TTS fault: a short reply started speculatively is often synthesized whole while the end of turn is still
being decided, and its audio is then released at once, leaving no moment "speaking and still synthesizing" to strike."""
CONFIGS = {"asr": SHORT_REPLY, "llm": SHORT_REPLY, "tts": SHORT_REPLY_AFTER_COMMIT}


@dataclass
class Conversation:
    """One simulated caller: what it said and heard, and the gateway session that served it."""

    index: int
    utterances: int
    turns: list[TalkTurn] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    error: str = ""


@dataclass
class FaultReport:
    stage: str
    kind: str
    victim: str
    sessions: int
    turns_attempted: int = 0
    turns_completed: int = 0
    turns_interrupted: int = 0  # the user spoke over the reply (it was heard in part): answered, not lost
    turns_lost: int = 0
    reply_frames: int = 0
    reply_frames_lost: int = 0
    input_frames_unacknowledged: int = 0
    recovery_ms: list[float] = field(default_factory=list)
    recovery_excess_ms: list[float] = field(default_factory=list)
    reply_gap_ms: list[float] = field(default_factory=list)  # the longest silence inside each reply the fault hit
    v2v_ms: dict[str, dict[str, float | int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    struck: str = ""  # the call the fault struck ("session 3f2a... generating on llm-b")
    missed: str = ""  # why the fault struck no call at its moment (it then struck the busiest replica): untested
    lost: list[dict[str, Any]] = field(default_factory=list)  # each conversation that lost a turn: what it heard

    @property
    def survived(self) -> bool:
        return not (self.turns_lost or self.reply_frames_lost or self.input_frames_unacknowledged or self.errors)


def two_replicas(log_dir: str | None = None) -> Mesh:
    """asr-a, asr-b, llm-a, llm-b, tts-a, tts-b on free loopback ports (not waited for).

    The two replicas of a stage share this box as two pods would share a node: each gets the engine threads of half
    its cores (`voicemesh.cpus`). With the services' own defaults (two threads each), two LLM replicas decoding while
    the ASRs decoded partials ran far more threads than the 2 cores, and a reply took 2 s a token: it was still
    being written when the conversation's next utterance came 6 s later."""
    mesh = Mesh(log_dir=log_dir or tempfile.mkdtemp(prefix="voicemesh-chaos-"))
    budget = budget_env(max(1, available_cpus() // 2))
    for stage in STAGES:
        for name in "ab":
            mesh.start(f"{stage}-{name}", free_port(), env=budget[stage])
    return mesh


async def start_gateway(mesh: Mesh) -> GatewayServer:
    """A gateway in this process over both replicas of every stage."""
    targets = {stage: ",".join(mesh.processes[f"{stage}-{n}"].target for n in "ab") for stage in STAGES}
    settings = GatewaySettings(
        port=0,
        http_port=-1,
        asr_target=targets["asr"],
        llm_target=targets["llm"],
        tts_target=targets["tts"],
        drain_grace_s=1,
    )
    server = build_server(settings)
    await server.start()
    return server


def script(clips: Sequence[Clip], utterances: int, offset: int) -> Clip:
    """`utterances` clips, each followed by GAP_S of silence, starting at clip `offset` (16 kHz)."""
    pieces: list[np.ndarray] = []
    for index in range(utterances):
        pieces += [clips[(offset + index) % len(clips)].to_rate(16000).samples, np.zeros(int(GAP_S * 16000))]
    return Clip(np.concatenate(pieces).astype(np.float32), 16000)


async def converse(
    target: str, conversation: Conversation, clip: Clip, delay_s: float, config: conversation_pb2.SessionConfig
) -> None:
    await asyncio.sleep(delay_s)
    try:
        conversation.turns, _, conversation.events = await talk(target, clip, config, trailing_silence_s=6.0)
    except Exception as error:  # a conversation that died is a figure, not a crash of the benchmark
        conversation.error = f"{type(error).__name__}: {error}"


@contextlib.contextmanager
def watching_sessions(server: GatewayServer, conversations: list[Conversation]) -> Iterator[None]:
    """Keep each gateway session (it leaves the registry when it ends) for the accounting after the run."""
    registry = server.registry
    assert registry is not None
    seen: dict[str, Session] = {}

    async def watch() -> None:
        while True:
            for session_id, session in registry.active.items():
                seen.setdefault(session_id, session)
            await asyncio.sleep(0.05)

    task = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        task.cancel()
        ordered = sorted(seen.values(), key=lambda s: s.options.session_id)
        for conversation in conversations:
            conversation.sessions = [s for s in ordered if _belongs(s, conversation)]


def _belongs(session: Session, conversation: Conversation) -> bool:
    return any(getattr(e, "session_id", None) == session.options.session_id for e in conversation.events)


def mid_utterance(session: Session) -> bool:
    """The user has been speaking for over a second (the ASR acknowledged it) and has not finished."""
    return session.asr.in_speech and session.asr.acked > 60


def generating(session: Session) -> bool:
    """A reply has streamed its first words and the LLM is still going."""
    return any(reply.text and not reply.llm_done for reply in session._replies.values())


def speaking(session: Session) -> bool:
    """The committed reply's audio is coming and its synthesis is not finished."""
    reply = session._current
    return reply is not None and reply.frames_released > 0 and not reply.tts_done


MOMENTS = {"asr": mid_utterance, "llm": generating, "tts": speaking}  # when a fault of each stage hurts most


# The replica each of the gateway's ASR and TTS streams is on (`tracking_streams`); the gateway keeps it in a local.
_STREAM_TARGETS: weakref.WeakKeyDictionary[ReconnectingStream[Any, Any], str] = weakref.WeakKeyDictionary()


Method = Callable[[ReconnectingStream[Any, Any], str], Callable[..., AsyncIterable[Any]]]


@contextlib.contextmanager
def tracking_streams() -> Iterator[None]:
    """While inside, note the replica each session's ASR and TTS stream connects to (`held_by` reads it)."""

    def tracked(original: Method) -> Method:
        def _method(self: ReconnectingStream[Any, Any], target: str) -> Callable[..., AsyncIterable[Any]]:
            _STREAM_TARGETS[self] = target
            return original(self, target)

        return _method

    with contextlib.ExitStack() as stack:
        for link in (AsrLink, TtsLink):
            stack.enter_context(mock.patch.object(link, "_method", tracked(link.__dict__["_method"])))
        yield


def held_by(server: GatewayServer, session: Session, stage: str) -> str | None:
    """The replica of `stage` holding `session`'s call now, where it is known: its live ASR or TTS stream's (under
    `tracking_streams`), or the LLM replica its replies go to first while every LLM replica is up."""
    backends = server.registry.backends if server.registry is not None else None
    assert backends is not None
    if stage == "llm":
        order = backends.llm_order(session.options.session_id)
        return order[0] if len(order) == len(backends.sets["llm"].replicas) else None
    link = session.asr if stage == "asr" else session.tts
    target = _STREAM_TARGETS.get(link)
    return target if target is not None and link.queue is not None else None


def replica_of(server: GatewayServer, session: Session, stage: str) -> str:
    """The replica of `stage` serving `session` now (with one session talking, the one with a call in flight)."""
    held = held_by(server, session, stage)
    if held is not None:
        return held
    backends = server.registry.backends if server.registry is not None else None
    assert backends is not None
    if stage == "llm":
        return backends.llm_order(session.options.session_id)[0]
    return next(t for t, load in backends.sets[stage].replicas.items() if load.in_flight)


async def strike_when(server: GatewayServer, stage: str, mesh: Mesh, timeout_s: float = 20.0) -> tuple[str, str, str]:
    """Wait until a session is where a fault of `stage` hurts most, on a replica known to hold its call; return
    (the replica's name, the call struck, ""), to be struck at once (no await in between). Past `timeout_s`: (the
    busiest replica's name, "", why no call was struck), for a benchmark to report and a test to fail on."""
    registry = server.registry
    assert registry is not None
    moment = MOMENTS[stage]
    names = {process.target: name for name, process in mesh.processes.items()}
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        for session in list(registry.active.values()):
            if not moment(session):
                continue
            target = held_by(server, session, stage)
            if target is None:
                seen.append(f"{session.options.session_id} {moment.__name__} on an unknown {stage} replica")
                continue
            return names[target], f"session {session.options.session_id} {moment.__name__} on {names[target]}", ""
        await asyncio.sleep(0.002)
    victim = victim_of(server, stage, mesh)
    why = (
        f"no session was {moment.__name__} on a known {stage} replica within {timeout_s:g} s, so {victim} (the "
        f"busiest) was struck at no particular call; {len(registry.active)} session(s) active; seen: {seen[-3:]}"
    )
    return victim, "", why


def victim_of(server: GatewayServer, stage: str, mesh: Mesh) -> str:
    """The replica of `stage` with the most of this gateway's work on it (any, when none has work)."""
    registry = server.registry
    assert registry is not None and registry.backends is not None
    backends = registry.backends
    if stage == "llm":
        counts: dict[str, int] = {}
        for session_id in registry.active:
            first = backends.llm_order(session_id)[0]
            counts[first] = counts.get(first, 0) + 1
    else:
        counts = {target: load.in_flight for target, load in backends.sets[stage].replicas.items()}
    target = max(sorted(counts), key=lambda t: counts[t]) if counts else mesh.processes[f"{stage}-a"].target
    return next(name for name, process in mesh.processes.items() if process.target == target)


async def inject(mesh: Mesh, victim: str, kind: str) -> None:
    """Apply the fault, hold it, then bring the replica back."""
    process = mesh.processes[victim].popen
    if kind == "sigkill":
        mesh.kill(victim)
        await asyncio.sleep(FAULT_HOLD_S)
        mesh.restart(victim)
    elif kind == "sigstop":
        mesh.freeze(victim)
        await asyncio.sleep(FAULT_HOLD_S)
        mesh.thaw(victim)
    else:
        process.send_signal(signal.SIGTERM)  # it drains: finishes what it holds, hands the rest back
        await asyncio.to_thread(process.wait, 60)
        await asyncio.sleep(max(0.0, FAULT_HOLD_S - 1))
        mesh.restart(victim)
    await mesh.wait(names=[victim])


async def run_fault(
    mesh: Mesh, stage: str, kind: str, clips: Sequence[Clip], sessions: int = 4, utterances: int = 4
) -> FaultReport:
    """`sessions` conversations of `utterances` turns; once the first round is done, the fault strikes a replica
    of `stage` at the moment it hurts most (mid-utterance, mid-generation, mid-speech)."""
    server = await start_gateway(mesh)
    target = f"127.0.0.1:{server.port}"
    conversations = [Conversation(index, utterances) for index in range(sessions)]
    first_turn_s = clips[0].duration_s + GAP_S
    try:
        with watching_sessions(server, conversations), tracking_streams():
            talks = [
                asyncio.ensure_future(
                    converse(target, c, script(clips, utterances, c.index), c.index * 0.7, CONFIGS[stage])
                )
                for c in conversations
            ]
            await asyncio.sleep(first_turn_s)
            victim, struck, missed = await strike_when(server, stage, mesh)
            fault_us = epoch_us()  # the strike follows at once: `inject` signals before its first await
            log.info("fault", extra={"stage": stage, "kind": kind, "victim": victim, "struck": struck})
            await inject(mesh, victim, kind)
            await asyncio.gather(*talks)
    finally:
        await server.stop()
    report = FaultReport(stage, kind, victim, sessions, struck=struck, missed=missed)
    return account(report, conversations, fault_us)


def account(report: FaultReport, conversations: list[Conversation], fault_us: int) -> FaultReport:
    phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for conversation in conversations:
        if conversation.error:
            report.errors.append(f"conversation {conversation.index}: {conversation.error}")
        done = {e.turn_index for e in conversation.events if isinstance(e, ReplyDone)}
        heard = {e.turn_index for e in conversation.events if isinstance(e, ReplyAudio)}
        completed = [t for t in conversation.turns if t.turn_index in done and not t.interrupted]
        interrupted = [t for t in conversation.turns if t.interrupted and t.turn_index in heard]
        report.turns_attempted += conversation.utterances
        report.turns_completed += min(len(completed), conversation.utterances)
        report.turns_interrupted += len(interrupted)
        lost = max(0, conversation.utterances - len(completed) - len(interrupted))
        report.turns_lost += lost
        if lost:
            report.lost.append(
                {
                    "conversation": conversation.index,
                    "turns": [
                        {"user": t.user_text, "replied": t.turn_index in done, "interrupted": t.interrupted}
                        for t in conversation.turns
                    ],
                    "errors": [
                        f"{e.stage}: {e.code} {e.message}" for e in conversation.events if isinstance(e, SessionError)
                    ],
                }
            )
        frames: dict[int, list[int]] = {}
        received: dict[int, list[int]] = {}
        heard_after: list[int] = []
        for event in conversation.events:
            if isinstance(event, ReplyAudio):
                frames.setdefault(event.turn_index, []).append(event.seq)
                received.setdefault(event.turn_index, []).append(event.received_us)
                if event.received_us > fault_us:
                    heard_after.append(event.received_us)
        for times in received.values():
            if times[0] <= fault_us <= times[-1]:  # a reply under way when the fault struck
                report.reply_gap_ms.append(max(b - a for a, b in itertools.pairwise(times)) / 1000)
        for seqs in frames.values():
            report.reply_frames += len(seqs)
            report.reply_frames_lost += (max(seqs) + 1 - len(set(seqs))) + (len(seqs) - len(set(seqs)))
        for session in conversation.sessions:
            report.input_frames_unacknowledged += max(0, session.asr.seq - session.asr.acked)
        for turn in completed:
            if turn.v2v_ms is None:
                continue
            end_us = turn.speech_end_sent_us
            phase = "before" if end_us < fault_us else "during" if end_us < fault_us + DURING_S * 1e6 else "after"
            phases[phase].append(turn.v2v_ms)
        report.recovery_ms += recovery(conversation, fault_us, heard_after)
    report.v2v_ms = {phase: summary(values) for phase, values in phases.items()}
    if phases["before"]:  # what the fault added: recovery beyond the V2V these conversations had before it
        baseline_ms = float(np.percentile(phases["before"], 50))
        report.recovery_excess_ms = [max(0.0, value - baseline_ms) for value in report.recovery_ms]
    return report


def recovery(conversation: Conversation, fault_us: int, heard_after: list[int]) -> list[float]:
    """From the fault, or from the end of the user's speech if that came later, to the next reply audio heard."""
    if not heard_after:
        return []
    heard_us = min(heard_after)
    ends = [t.speech_end_sent_us for t in conversation.turns if 0 < t.speech_end_sent_us <= heard_us]
    return [(heard_us - max([fault_us, *ends])) / 1000]


def summary(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": round(float(np.percentile(values, 50)), 1),
        "p99": round(float(np.percentile(values, 99)), 1),
    }


def as_json(report: FaultReport) -> dict[str, Any]:
    data = dataclasses.asdict(report)
    data["survived"] = report.survived
    data["recovery_ms"] = summary(report.recovery_ms) | {"values": [round(v) for v in report.recovery_ms]}
    data["recovery_excess_ms"] = summary(report.recovery_excess_ms)
    data["recovery_excess_values"] = [round(v) for v in report.recovery_excess_ms]
    data["reply_gap_ms"] = summary(report.reply_gap_ms) | {"values": [round(v) for v in report.reply_gap_ms]}
    return data


def faults(stages: Sequence[str], kinds: Sequence[str]) -> list[tuple[str, str]]:
    return [(stage, kind) for stage in stages for kind in kinds]
