"""Async client for the gateway's Conversation.Converse: typed events, reconnects with the same session id."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import grpc
import numpy as np

from voicemesh import stages
from voicemesh.audio import FRAME_MS, Clip
from voicemesh.clients import PLAINTEXT, Credentials, epoch_us, paced, pcm_frame
from voicemesh.v1 import conversation_pb2, conversation_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Started:
    session_id: str
    history_turns: int
    resume_token: str = ""


@dataclass(frozen=True)
class UserTranscript:
    turn_index: int
    text: str
    final: bool
    stable_prefix: str = ""


@dataclass(frozen=True)
class ReplyText:
    turn_index: int
    text_delta: str


@dataclass(frozen=True)
class ReplyAudio:
    turn_index: int
    pcm16: bytes
    sample_rate_hz: int
    text: str
    sent_us: int
    received_us: int
    seq: int = 0  # the frame's place in its turn's reply, from 0: a gap is a lost frame


@dataclass(frozen=True)
class Interrupted:
    turn_index: int
    spoken_text: str
    continued: bool = False  # nothing was heard: the next turn's text includes this turn's words


@dataclass(frozen=True)
class ReplyDone:
    turn_index: int
    text: str


@dataclass(frozen=True)
class TurnMetrics:
    turn_index: int
    server: conversation_pb2.TurnMetrics
    first_audio_received_us: int = 0

    @property
    def downlink_ms(self) -> float:
        if not (self.first_audio_received_us and self.server.first_audio_sent_us):
            return 0.0
        return (self.first_audio_received_us - self.server.first_audio_sent_us) / 1000


@dataclass(frozen=True)
class SessionError:
    turn_index: int
    stage: str
    code: str
    message: str
    recoverable: bool


Event = Started | UserTranscript | ReplyText | ReplyAudio | Interrupted | ReplyDone | TurnMetrics | SessionError


@dataclass
class ConversationClient:
    """One conversation with the gateway. `send` audio, iterate `events()`; `close` ends the user's side.

    If the call drops (gateway restart, network), it reconnects with the same session id, so the gateway
    continues the same history; audio sent while disconnected is lost, and a SessionError says so.
    """

    target: str
    config: conversation_pb2.SessionConfig
    reconnect_attempts: int = 5
    credentials: Credentials = PLAINTEXT
    _queue: asyncio.Queue[conversation_pb2.ConverseRequest | None] = field(default_factory=asyncio.Queue)
    _seq: int = 0
    _first_audio_us: dict[int, int] = field(default_factory=dict)
    _channel: grpc.aio.Channel | None = None
    _closed: bool = False
    _accepted: asyncio.Event = field(default_factory=asyncio.Event)

    async def __aenter__(self) -> ConversationClient:
        self._channel = self.credentials.channel(self.target)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()

    def send(self, pcm16: bytes) -> None:
        """Queue one frame of PCM16 audio at the configured input rate (stamped with its capture time now)."""
        self._queue.put_nowait(
            conversation_pb2.ConverseRequest(frame=pcm_frame(pcm16, self.config.input_sample_rate_hz, self._seq))
        )
        self._seq += 1

    def close(self) -> None:
        """No more audio: the gateway finishes the last turn, then ends the event stream."""
        self._closed = True
        self._accepted.set()
        self._queue.put_nowait(None)

    async def _requests(self, accepted: asyncio.Event) -> AsyncIterator[conversation_pb2.ConverseRequest]:
        yield conversation_pb2.ConverseRequest(config=self.config)
        # Frames wait (queued, capture times kept) until the gateway has accepted the session. A gateway that
        # refuses it ends the call at once, and a frame written into that ending call makes grpcio report
        # INTERNAL "Internal error from Core" instead of the gateway's status (grpc/grpc#36066).
        await accepted.wait()
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if item.WhichOneof("request") == "frame":
                item.frame.seq = self._call_seq
                self._call_seq += 1
            yield item

    async def events(self) -> AsyncIterator[Event]:
        assert self._channel is not None, "use `async with ConversationClient(...)`"
        stub = conversation_pb2_grpc.ConversationStub(self._channel)
        attempts, core_retried = 0, False
        while True:
            self._call_seq = 0  # seq restarts with each call
            self._accepted = accepted = asyncio.Event()
            if self._closed:
                accepted.set()
            call = stub.Converse(self._requests(accepted), metadata=self.credentials.metadata())
            received = False
            try:
                async for message in call:
                    attempts, received = 0, True
                    accepted.set()
                    event = self._convert(message)
                    if isinstance(event, Started):
                        # Reconnects continue this session, proving they own it.
                        self.config.session_id = event.session_id
                        self.config.resume_token = event.resume_token or self.config.resume_token
                    yield event
                return
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.INTERNAL and not received and not core_retried:
                    # A gateway that refuses the session at once can race the config's write, and grpcio then
                    # reports INTERNAL instead of the gateway's status (grpc/grpc#36066): ask once more to learn it.
                    core_retried = True
                    continue
                retryable = error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
                if not retryable or self._closed or attempts >= self.reconnect_attempts:
                    raise
                attempts += 1
                log.warning("conversation dropped; reconnecting", extra={"code": error.code().name})
                yield SessionError(0, "gateway", error.code().name, f"reconnecting: {error.details()}", True)
                await asyncio.sleep(0.2 * 2**attempts)
            finally:
                accepted.set()  # the call's request stream goes on to its end instead of waiting forever

    def _convert(self, message: conversation_pb2.ConverseEvent) -> Event:
        event = event_from(message, self._first_audio_us)
        if isinstance(event, ReplyAudio) and self._first_audio_us[event.turn_index] == event.received_us:
            if not self._closed:  # the turn's first audio: tell the gateway, which records the downlink stage
                report = conversation_pb2.ClientReport(
                    turn_index=event.turn_index, first_audio_received_us=event.received_us
                )
                self._queue.put_nowait(conversation_pb2.ConverseRequest(report=report))
        return event


class ConversationFailed(Exception):
    """A conversation the gateway ended with an error (on doors that have no gRPC status to raise)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


def event_from(message: conversation_pb2.ConverseEvent, first_audio_us: dict[int, int]) -> Event:
    """A Converse event as the typed event it is; `first_audio_us` (turn -> when its first audio came) is updated."""
    turn = message.turn_index
    kind = message.WhichOneof("event")
    if kind == "started":
        started = message.started
        return Started(started.session_id, started.history_turns, started.resume_token)
    if kind in ("user_partial", "user_final"):
        transcript = getattr(message, kind)
        return UserTranscript(turn, transcript.text, kind == "user_final", transcript.stable_prefix)
    if kind == "reply_text":
        return ReplyText(turn, message.reply_text.text_delta)
    if kind == "reply_audio":
        now = epoch_us()
        first_audio_us.setdefault(turn, now)
        frame = message.reply_audio.frame
        return ReplyAudio(
            turn, frame.data, frame.sample_rate_hz, message.reply_audio.text, frame.capture_time_us, now, frame.seq
        )
    if kind == "interrupted":
        return Interrupted(turn, message.interrupted.spoken_text, message.interrupted.continued)
    if kind == "reply_done":
        return ReplyDone(turn, message.reply_done.text)
    if kind == "metrics":
        return TurnMetrics(turn, message.metrics, first_audio_us.get(turn, 0))
    error = message.error
    return SessionError(turn, error.stage, error.code, error.message, error.recoverable)


def speech_frames(frames: list[bytes], floor_dbfs: float = -75.0, below_peak_db: float = 35.0) -> list[bool]:
    """Which 20 ms frames hold speech, by energy relative to the clip's loudest frame: the client's own view of
    where speech ends. The absolute floor only keeps near-digital silence out, so a quiet speaker (a distant
    microphone, speech around -50 dBFS) still has an end of speech to measure V2V from."""
    threshold = speech_threshold(frames, floor_dbfs, below_peak_db)
    return [level_dbfs(frame) > threshold for frame in frames]


def speech_threshold(frames: list[bytes], floor_dbfs: float = -75.0, below_peak_db: float = 35.0) -> float:
    """The level (dBFS) above which a frame of these holds speech (`speech_frames`)."""
    loudest = max((level_dbfs(frame) for frame in frames), default=floor_dbfs)
    return max(floor_dbfs, loudest - below_peak_db)


def level_dbfs(frame: bytes) -> float:
    """The RMS level of a 16-bit PCM frame in dBFS."""
    return float(20 * np.log10(np.sqrt(np.mean((np.frombuffer(frame, "<i2") / 32768.0) ** 2)) + 1e-12))


def speech_end_sent_us(sent: Iterable[tuple[int, bool]], server_speech_end_us: int) -> int:
    """Where the user's speech ended, as the client measures V2V from: the send time (epoch us) of the last frame
    with speech energy sent no later than one frame after where the server's VAD put the end (background noise
    in the pause after it is not speech); the server's own time when no such frame was sent.

    `sent` holds (send time epoch us, is speech per `speech_frames`) of each frame sent, in order."""
    limit_us = server_speech_end_us + FRAME_MS * 1000
    spoken = [sent_us for sent_us, is_speech in sent if is_speech and sent_us <= limit_us]
    return spoken[-1] if spoken else server_speech_end_us


@dataclass
class TalkTurn:
    turn_index: int
    user_text: str = ""
    reply_text: str = ""
    interrupted: bool = False
    speech_end_sent_us: int = 0
    first_audio_received_us: int = 0
    metrics: TurnMetrics | None = None

    @property
    def v2v_ms(self) -> float | None:
        if not (self.first_audio_received_us and self.speech_end_sent_us):
            return None
        return (self.first_audio_received_us - self.speech_end_sent_us) / 1000

    @property
    def _server(self) -> conversation_pb2.TurnMetrics:
        return self.metrics.server if self.metrics else conversation_pb2.TurnMetrics()

    @property
    def stages_ms(self) -> dict[str, float]:
        """Every stage of the turn, to 0.1 ms: the gateway's own, and the downlink as this client measured it."""
        return {
            **{name: round(value_ms, 1) for name, value_ms in stages.server_stages_ms(self._server).items()},
            "downlink": round(self.metrics.downlink_ms, 1) if self.metrics else 0.0,
        }

    @property
    def server_v2v_ms(self) -> float:
        """V2V as the gateway measured it, to 0.1 ms (0 before its metrics arrive)."""
        return round(self._server.v2v_ms, 1)

    def as_dict(self) -> dict[str, object]:
        server = self._server
        return {
            "turn": self.turn_index,
            "user": self.user_text,
            "reply": self.reply_text,
            "interrupted": self.interrupted,
            "v2v_ms": None if self.v2v_ms is None else round(self.v2v_ms, 1),
            "stages_ms": self.stages_ms,
            "server_v2v_ms": self.server_v2v_ms,
            "speculative_used": server.speculative_used,
            "speculative_discarded": server.speculative_discarded,
            "llm_replica": server.llm_replica,
            "prompt_tokens": server.prompt_tokens,
            "cached_prompt_tokens": server.cached_prompt_tokens,
            "completion_tokens": server.completion_tokens,
        }


@dataclass(frozen=True)
class AfterFirstAudio:
    """An `inject` offset counted from when the reply's first audio arrives: speech over a reply whose start
    varies with the machine's load."""

    seconds: float


async def talk(
    target: str,
    clip: Clip,
    config: conversation_pb2.SessionConfig | None = None,
    trailing_silence_s: float = 4.0,
    inject: list[tuple[float | AfterFirstAudio, Clip]] | None = None,
    credentials: Credentials = PLAINTEXT,
) -> tuple[list[TalkTurn], bytes, list[Event]]:
    """Speak a clip to the gateway in real time, then silence; returns the turns, the reply audio, all events.

    `inject` plays more clips mixed into the stream, each at an offset in seconds from the start, or an
    `AfterFirstAudio` one: a user talking over the reply, for barge-in tests.
    """
    cfg = conversation_pb2.SessionConfig(input_sample_rate_hz=16000, output_sample_rate_hz=16000)
    if config is not None:
        cfg.MergeFrom(config)
    rate = cfg.input_sample_rate_hz
    frames = clip.to_rate(rate).frames()
    silence = b"\x00" * len(frames[0])
    frames += [silence] * int(trailing_silence_s * 1000 / FRAME_MS)
    after_audio = [(at.seconds, extra) for at, extra in inject or [] if isinstance(at, AfterFirstAudio)]

    def mix(start: int, extra: Clip) -> None:
        for index, data in enumerate(extra.to_rate(rate).frames()):
            while start + index >= len(frames):
                frames.append(silence)
            mixed = np.frombuffer(frames[start + index], "<i2").astype(np.int32) + np.frombuffer(data, "<i2")
            frames[start + index] = np.clip(mixed, -32768, 32767).astype("<i2").tobytes()

    for at, extra in inject or []:
        if not isinstance(at, AfterFirstAudio):
            mix(int(at * 1000 / FRAME_MS), extra)
    # Where speech ends is judged against the clip's own loudness; a clip mixed in later is judged the same way.
    threshold = speech_threshold(frames)
    sent: list[tuple[int, bool]] = []  # (send time epoch us, is speech) of each frame
    turns: dict[int, TalkTurn] = {}
    audio = bytearray()
    events: list[Event] = []
    async with ConversationClient(target, cfg, credentials=credentials) as client:

        async def stream() -> None:
            async for _, data in paced(frames):  # by index: frames mixed or added later are sent too
                sent.append((epoch_us(), level_dbfs(data) > threshold))
                client.send(data)
            client.close()

        sender = asyncio.ensure_future(stream())
        try:
            async for event in client.events():
                events.append(event)
                turn = getattr(event, "turn_index", None)
                if turn is None or isinstance(event, SessionError):
                    continue
                record = turns.setdefault(turn, TalkTurn(turn))
                if isinstance(event, UserTranscript) and event.final:
                    record.user_text = event.text
                elif isinstance(event, ReplyText):
                    record.reply_text += event.text_delta
                elif isinstance(event, ReplyAudio):
                    record.first_audio_received_us = record.first_audio_received_us or event.received_us
                    for seconds, extra in after_audio:  # the frames from here on are not sent yet
                        mix(len(sent) + round(seconds * 1000 / FRAME_MS), extra)
                    after_audio = []
                    audio += event.pcm16
                elif isinstance(event, Interrupted):
                    record.interrupted = True
                elif isinstance(event, TurnMetrics):
                    record.metrics = event
                    record.speech_end_sent_us = speech_end_sent_us(sent, event.server.speech_end_capture_us)
        finally:
            sender.cancel()
    return [turns[k] for k in sorted(turns) if turns[k].user_text], bytes(audio), events
