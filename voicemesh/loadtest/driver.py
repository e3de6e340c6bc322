"""Runs one load test: N concurrent Conversation.Converse sessions speak their clips at real-time pace, one turn
per clip, and every turn's outcome (V2V and stages, or why it failed) is recorded for the report."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from voicemesh.audio import FRAME_MS
from voicemesh.clients import Pacer, epoch_us
from voicemesh.conversation import (
    ConversationClient,
    ConversationFailed,
    Interrupted,
    ReplyText,
    SessionError,
    TalkTurn,
    TurnMetrics,
    UserTranscript,
    speech_end_sent_us,
)
from voicemesh.conversation_phone import PhoneConversationClient
from voicemesh.conversation_realtime import RealtimeConversationClient
from voicemesh.conversation_ws import WebSocketConversationClient
from voicemesh.loadtest.clips import RATE_HZ, SpeechClip, load_clips
from voicemesh.loadtest.html_report import render_report
from voicemesh.loadtest.options import LoadTestOptions, check_options
from voicemesh.loadtest.report import (
    NOT_STARTED,
    OK,
    LoadTestReport,
    ReportFiles,
    SessionRow,
    TurnRow,
    build_report,
)
from voicemesh.mesh import LOCAL_TWILIO_AUTH_TOKEN, local_mesh
from voicemesh.v1 import conversation_pb2

Client = ConversationClient | WebSocketConversationClient | PhoneConversationClient | RealtimeConversationClient

log = logging.getLogger(__name__)

SILENCE_FRAME = b"\x00" * (RATE_HZ * FRAME_MS // 1000 * 2)
CLOSE_TIMEOUT_S = 5.0
Result = TypeVar("Result")


def _since_s(us: int, origin_us: int) -> float | None:
    """Seconds from `origin_us` to `us` (epoch us), or None for a time never recorded (0)."""
    return round((us - origin_us) / 1e6, 3) if us else None


def _ahead_min_ms(answer: TalkTurn | None) -> float | None:
    """How far ahead of playout the reply's later chunks came, at the tightest; None for a reply of one chunk."""
    if answer is None or answer.metrics is None or not answer.metrics.server.HasField("reply_ahead_min_ms"):
        return None
    return answer.metrics.server.reply_ahead_min_ms


@dataclass
class TurnResult:
    """One turn of one session while the test runs: its clip's send times, then its outcome."""

    session: int
    turn: int
    clip: str
    status: str = NOT_STARTED
    detail: str = ""
    clip_start_us: int = 0
    clip_end_us: int = 0
    answer: TalkTurn | None = None
    """The turn as the client saw it once the gateway's metrics arrived."""
    extra_server_turns: int = 0
    errors: list[str] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def fail(self, status: str, detail: str) -> None:
        if self.done.is_set():
            return
        self.status, self.detail = status, detail
        self.done.set()

    def row(self, origin_us: int) -> TurnRow:
        answer = self.answer
        server = None if answer is None or answer.metrics is None else answer.metrics.server
        return TurnRow(
            session=self.session,
            turn=self.turn,
            clip=self.clip,
            status=self.status,
            ok=self.status == OK,
            detail=self.detail,
            v2v_ms=None if answer is None or answer.v2v_ms is None else round(answer.v2v_ms, 1),
            server_v2v_ms=None if answer is None else answer.server_v2v_ms,
            stages_ms={} if answer is None else answer.stages_ms,
            clip_start_s=_since_s(self.clip_start_us, origin_us),
            clip_end_s=_since_s(self.clip_end_us, origin_us),
            speech_end_s=None if answer is None else _since_s(answer.speech_end_sent_us, origin_us),
            first_audio_s=None if answer is None else _since_s(answer.first_audio_received_us, origin_us),
            user="" if answer is None else answer.user_text,
            reply="" if answer is None else answer.reply_text,
            interrupted=answer is not None and answer.interrupted,
            reply_gap_ms=0.0 if server is None else server.reply_gap_ms,
            reply_ahead_min_ms=_ahead_min_ms(answer),
            extra_server_turns=self.extra_server_turns,
            errors=self.errors,
            hangover_ms=None if server is None else server.hangover_ms,
            turn_score_ms=None if server is None or not server.turn_score_ms else round(server.turn_score_ms, 1),
            turn_end_from_prefill=server is not None and server.turn_end_from_prefill,
        )


class Rendezvous:
    """`sync` arrival: each turn's clips start together, once every session still running is ready for that turn."""

    def __init__(self, sessions: int) -> None:
        self._running = set(range(sessions))
        self._ready: dict[int, set[int]] = {}
        self._go: dict[int, asyncio.Event] = {}

    def ready(self, session: int, turn: int) -> asyncio.Event:
        """Session `session` is ready to speak turn `turn`; the event is set when everyone is."""
        self._ready.setdefault(turn, set()).add(session)
        self._check(turn)
        return self._go.setdefault(turn, asyncio.Event())

    def leave(self, session: int) -> None:
        """The session has ended (done or failed): nobody waits for it any more."""
        self._running.discard(session)
        for turn in self._ready:
            self._check(turn)

    def _check(self, turn: int) -> None:
        if self._running <= self._ready.get(turn, set()):
            self._go.setdefault(turn, asyncio.Event()).set()


class _Session:
    """One conversation: speaks its clips turn by turn, waits out each reply, records each turn's outcome.

    After each clip it streams silence until that turn's reply has finished (its TurnMetrics arrives), then a
    natural pause, so the client never talks over the bot (that would be barge-in).
    """

    def __init__(
        self,
        index: int,
        options: LoadTestOptions,
        plan: list[SpeechClip],
        run_id: str,
        rendezvous: Rendezvous | None = None,
    ) -> None:
        self.index = index
        self.rendezvous = rendezvous
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

    def row(self, origin_us: int) -> SessionRow:
        return SessionRow(
            session=self.index,
            session_id=self.session_id,
            started_s=_since_s(self.started_us, origin_us),
            ended_s=_since_s(self.ended_us, origin_us),
            error=self.error,
        )

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
            if self.rendezvous is not None:
                self.rendezvous.leave(self.index)

    def _open_client(self) -> Client:
        config = conversation_pb2.SessionConfig(
            session_id=self.session_id, input_sample_rate_hz=RATE_HZ, output_sample_rate_hz=RATE_HZ
        )
        if self.options.transport == "twilio":
            return PhoneConversationClient(self.options.target, config, self.options.twilio_auth_token)
        if self.options.transport == "ws":
            return WebSocketConversationClient(self.options.target, config, credentials=self.options.credentials)
        if self.options.transport == "realtime":
            return RealtimeConversationClient(self.options.target, config, credentials=self.options.credentials)
        # No reconnects: a dropped call is a failure the load test must count, not hide.
        return ConversationClient(
            self.options.target, config, reconnect_attempts=0, credentials=self.options.credentials
        )

    def fail_rest(self, status: str, detail: str) -> None:
        """The call is over: every turn not yet finished fails with its status."""
        unfinished = [turn for turn in self.turns if not turn.done.is_set()]
        if unfinished and not self.error:
            self.error = f"{status}: {detail}"
        for turn in unfinished:
            turn.fail(status, detail)

    async def _send(self, client: Client) -> None:
        pacer = Pacer()
        for number, (turn, clip) in enumerate(zip(self.turns, self.plan, strict=True)):
            if self.rendezvous is not None:
                go = self.rendezvous.ready(self.index, number)
                while not go.is_set():  # silence until every session is ready: then all speak at once
                    await pacer.wait()
                    client.send(SILENCE_FRAME)
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
                for _ in range(round(self.rng.uniform(*self.options.pause_s) * 1000 / FRAME_MS)):
                    await pacer.wait()
                    client.send(SILENCE_FRAME)

    async def _receive(self, client: Client) -> None:
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
        except ConversationFailed as error:
            self.fail_rest(error.code, error.details)
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
        turn.answer = answer = TalkTurn(
            event.turn_index,
            user_text=self._user_text.get(event.turn_index, ""),
            reply_text="".join(self._reply_text.get(event.turn_index, [])),
            interrupted=event.turn_index in self._interrupted,
            speech_end_sent_us=speech_end_sent_us(self.sent, event.server.speech_end_capture_us),
            first_audio_received_us=event.first_audio_received_us,
            metrics=event,
        )
        if answer.v2v_ms is None:
            status, _, message = (turn.errors[0] if turn.errors else "NO_AUDIO").partition(": ")
            turn.fail(status, message or "the turn ended without reply audio")
            return
        turn.status = OK
        turn.done.set()


async def loadtest(options: LoadTestOptions, out_dir: str | Path | None = None) -> LoadTestReport:
    """Run one load test against `options.target`; returns the report (and writes JSON + HTML to `out_dir`)."""
    check_options(options)
    clips = load_clips(options.audio)
    run_id = uuid.uuid4().hex[:8]
    # Session i starts at clip i, so concurrent sessions say different things.
    rendezvous = Rendezvous(options.sessions) if options.arrival == "sync" else None
    sessions = [
        _Session(
            index,
            options,
            [clips[(index + number) % len(clips)] for number in range(options.turns)],
            run_id,
            rendezvous,
        )
        for index in range(options.sessions)
    ]
    origin_us = epoch_us()
    started = time.monotonic()

    async def start(session: _Session) -> None:
        if rendezvous is None:
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
    report = build_report(
        options,
        clips,
        [session.row(origin_us) for session in sessions],
        [turn.row(origin_us) for session in sessions for turn in session.turns],
        origin_us,
        wall_s,
        files=None if out_dir is None else ReportFiles.under(out_dir, "loadtest"),
    )
    if report.files is not None:
        report.files.write(report.to_json(), render_report(report))
    return report


def on_target(options: LoadTestOptions, run: Callable[[LoadTestOptions], Coroutine[Any, Any, Result]]) -> Result:
    """Run `run(options)` from synchronous code; an empty `options.target` starts (and stops) a local mesh for it."""
    if options.target:
        return asyncio.run(run(options))
    with local_mesh("voicemesh-loadtest-", door=options.transport) as target:
        return asyncio.run(run(local_target(options, target)))


def local_target(options: LoadTestOptions, target: str) -> LoadTestOptions:
    """The options aimed at a local mesh this process started (whose Twilio door knows the local token)."""
    return dataclasses.replace(
        options, target=target, twilio_auth_token=options.twilio_auth_token or LOCAL_TWILIO_AUTH_TOKEN
    )


def run_loadtest(options: LoadTestOptions, out_dir: str | Path | None = None) -> LoadTestReport:
    """`loadtest` from synchronous code; an empty `options.target` starts (and stops) a local mesh for it."""
    return on_target(options, lambda resolved: loadtest(resolved, out_dir))
