"""One conversation: the I/O around its TurnController (gateway/turn.py), which decides everything about the turn.

The session feeds the controller the ASR's events, reply progress and the clock, and carries out its commands:
start / cancel / confirm / commit a reply (a ReplyRun streams it from the LLM into the TTS), score a pause, pause /
resume / stop the reply's audio, end the turn. Its parts: the ASR and TTS streams (gateway/links.py), the replies
(gateway/reply.py), the client's events (gateway/outbox.py), the measurements (gateway/recorder.py) and the playout
(gateway/playout.py), which the transport plays out in real time and which tells the session what was heard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from gateway import turn
from gateway.backends import Backends
from gateway.history import HistoryEntry, TurnEntries, drop_oldest, prompt_messages, trim_history
from gateway.links import AsrLink, TtsLink
from gateway.options import SessionOptions
from gateway.outbox import Outbox
from gateway.playout import Playout
from gateway.recorder import TurnRecorder
from gateway.reply import Reply, ReplyFrame, ReplyRun
from voicemesh import telemetry
from voicemesh.clients import epoch_us
from voicemesh.v1 import asr_pb2, audio_pb2, conversation_pb2, llm_pb2
from voicemesh.workers import Newest

__all__ = ["HistoryEntry", "ReplyFrame", "Session", "trim_history"]

log = logging.getLogger(__name__)

FINISH_TIMEOUT_S = 60.0


def _now_ms() -> float:
    return time.monotonic_ns() / 1e6


class Session:
    """The pipeline of one conversation, independent of the transport (gRPC Converse, WebSocket, WebRTC).

    The transport calls `push_frame` for each validated input frame and `finish` when the user's side ends,
    forwards `events` (ConverseEvent; a RequestError for a fatal problem; None at the end) and plays `playout`
    (the reply's audio, which is not among the events).
    """

    def __init__(
        self,
        options: SessionOptions,
        backends: Backends,
        history: list[HistoryEntry],
        transport: str = "grpc",
        log_transcripts: bool = False,
        history_max_chars: int = 0,
        history_max_tokens: int = 0,
    ) -> None:
        self.options = options
        self.history_max_chars = history_max_chars  # 0 = unbounded
        self.history_max_tokens = history_max_tokens  # by the LLM's own count of the last turn; 0 = unbounded
        self.resume_token = ""  # the secret that lets this session's owner resume it (set by the registry)
        self.pipeline = pipeline = options.pipeline
        self.backends = backends
        self.history = history
        self.transport = transport
        self.outbox = Outbox(options.session_id, len([entry for entry in history if entry.role == "user"]))
        self.events = self.outbox.events
        self.recorder = TurnRecorder(self.outbox, transport, log_transcripts)
        self.turns = turn.TurnController(pipeline.turn_policy())
        self.entries = TurnEntries()  # the history lines of recent turns, for a client that edits them
        self.on_speech: Callable[[bool, float], None] | None = None  # (started, session audio ms): for a door
        self._closing = False
        self._replies: dict[int, Reply] = {}  # the live replies, by utterance id
        self.replies = self._replies
        self._current: Reply | None = None
        self._last_event: asr_pb2.RecognizeEvent | None = None  # the ASR event being handled
        self._tick_handle: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        # A reply on its way evaluates the prompt in its own call.
        self._prefills = Newest(self._prefill, held=lambda: bool(self._replies) or self._closing)
        self.playout: Playout[ReplyFrame] = Playout(self._played)
        # A door whose listener reports what it heard (a carrier's marks) sets this: a chunk of the reply then counts
        # as spoken once `confirm_heard` says so, not when its last frame is sent.
        self.heard_on_confirmation = False
        self.asr = AsrLink(options, backends, self.outbox, self)
        self.tts = TtsLink(options, backends, self.outbox, self)
        self._tasks = [
            asyncio.ensure_future(self.outbox.supervised("asr", self.asr.run)),
            asyncio.ensure_future(self.outbox.supervised("tts", self.tts.run)),
        ]

    # ---- input -----------------------------------------------------------------------------------------
    def push_frame(self, frame: audio_pb2.AudioFrame) -> None:
        now_us = epoch_us()
        capture_us = frame.capture_time_us or now_us
        self.recorder.received(capture_us, now_us)
        self.asr.push(frame, capture_us)

    def on_client_report(self, report: conversation_pb2.ClientReport) -> None:
        """The client's own times of a turn (gateway/recorder.py)."""
        self.recorder.on_client_report(report, self._current)

    def on_dtmf(self, digit: str, duration_ms: int = 0) -> None:
        """A key the caller pressed (a phone door's DTMF): an event for whoever follows the session."""
        log.info("dtmf", extra={"session_id": self.options.session_id, "digit": digit})
        self.outbox.emit(dtmf=conversation_pb2.Dtmf(digit=digit, duration_ms=duration_ms))

    def deliver(self, event: conversation_pb2.ConverseEvent) -> None:
        """Queue an event for the client (bounded: gateway/outbox.py)."""
        self.outbox.deliver(event)

    async def finish(self) -> None:
        """The user's side ended: flush the ASR, let the last reply play out, then end the event stream."""
        self.asr.close()
        self._closing = True
        try:
            await asyncio.wait_for(self._tasks[0], FINISH_TIMEOUT_S)
            await asyncio.wait_for(self._idle.wait(), FINISH_TIMEOUT_S)
        except TimeoutError:
            log.warning("session did not finish in time", extra={"session_id": self.options.session_id})
        self.events.put_nowait(None)

    async def until_idle(self) -> None:
        """Return once no reply is being generated or spoken (at once if none is)."""
        await self._idle.wait()

    async def close(self) -> None:
        self._closing = True
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        for reply in list(self._replies.values()):
            self._cancel_reply(reply)
        await self._prefills.close()
        self.playout.flush()
        self.asr.close()  # the request iterators end, and with them gRPC's writer tasks
        self.tts.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- a client that asks for replies itself (the OpenAI Realtime door) -----------------------------------------
    def reply_on_turns(self, on: bool) -> None:
        """Off: a committed turn is only transcribed (user_final); the client asks for each reply with `respond`."""
        self.turns.policy = dataclasses.replace(self.turns.policy, reply_to_turns=on)

    def respond(self, user_text: str) -> int | None:
        """Reply to `user_text` as a committed turn; its turn index, or None while a reply is current."""
        turn_index = self.outbox.turn_index
        commands = self.turns.on_user_text(user_text)
        self._apply(commands)
        return turn_index if commands else None

    def cancel_reply(self) -> bool:
        """Stop the current reply as a barge-in would (what was heard stays in the history); False if none."""
        commands = self.turns.on_cancel()
        self._apply(commands)
        return bool(commands)

    # ---- events in -------------------------------------------------------------------------------------------
    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def asr_waits_for_scores(self) -> bool:
        return self.turns.asks_for_scores

    def on_asr_restarted(self) -> None:
        self._apply(self.turns.on_asr_restarted())

    def on_asr_event(self, event: asr_pb2.RecognizeEvent) -> None:
        """Hand the ASR's event to the turn controller, on the session's clock."""
        now_ms = _now_ms()
        kind = event.WhichOneof("event")
        self._last_event = event
        controller = self.turns
        if self.on_speech is not None and kind in ("speech_started", "speech_stopped", "speech_resumed"):
            self.on_speech(kind != "speech_stopped", self.asr.session_ms(event))
        if kind == "speech_started":
            commands = controller.on_speech_started(now_ms - self.asr.behind_ms(event.speech_start_ms))
        elif kind == "speech_stopped":
            commands = controller.on_speech_stopped(now_ms - self.asr.behind_ms(event.speech_end_ms))
        elif kind == "partial":
            partial = event.partial
            self.outbox.emit(
                user_partial=conversation_pb2.Transcript(text=partial.text, stable_prefix=partial.stable_prefix)
            )
            commands = controller.on_partial(now_ms, partial.text)
        elif kind == "endpoint_candidate":
            candidate = event.endpoint_candidate
            commands = controller.on_candidate(now_ms, candidate.text.strip(), candidate.pause_id)
        elif kind == "speech_resumed":
            commands = controller.on_speech_resumed(now_ms)
        elif kind == "final":
            commands = controller.on_final(now_ms, event.final.text.strip())
        else:
            return
        self._apply(commands)

    def on_turn_end(self, reply: Reply, probability: float | None, scorer_missing: bool = False) -> None:
        """The LLM's P(turn end) of the reply's words (None: none will come; `scorer_missing`: it cannot score)."""
        if probability is not None:
            reply.mark("turn_scored")
            reply.turn_end = probability
            self._apply(self.turns.on_reply_scored(reply.utterance_id, probability))
            return
        available = self.turns.scorer_available
        commands = self.turns.on_reply_unscored(reply.utterance_id, scorer_missing)
        if available and not self.turns.scorer_available:
            log.info("the LLM does not score turn ends; the ASR stops waiting for its scores")
        self._apply(commands)

    async def _prefill(self, user_text: str) -> None:
        messages = prompt_messages(self.options.system_prompt, self.history, user_text)
        request = llm_pb2.PrefillRequest(session_id=self.options.session_id, messages=messages)
        dialogue = (self.outbox.turn_index, len(self.history))
        try:
            response = await self.backends.prefill(request)
            if response is not None and response.HasField("turn_end"):
                if (self.outbox.turn_index, len(self.history)) == dialogue:
                    # Of the dialogue as it still is; a score that says the turn is finished may start the reply now.
                    self._apply(self.turns.on_prefilled(user_text, response.turn_end.probability))
        except grpc.aio.AioRpcError as error:  # best effort: the reply then evaluates these words itself
            telemetry.PREFILLS.labels("failed").inc()
            log.info(
                "prefill failed",
                extra={"session_id": self.options.session_id, "code": error.code().name, "reason": error.details()},
            )

    # ---- commands -----------------------------------------------------------------------------------------
    def _apply(self, commands: list[turn.Command]) -> None:
        for command in commands:
            match command:
                case turn.StartReply():
                    self._start_reply(command)
                case turn.Prefill(user_text):
                    self._prefills.offer(user_text)
                case turn.CancelReply(reply_id):
                    if (reply := self._replies.get(reply_id)) is not None:
                        self._discard(reply)
                case turn.ConfirmReply(reply_id):
                    if (reply := self._replies.get(reply_id)) is not None and not reply.confirmed.is_set():
                        reply.confirmed.set()  # it may write the rest of its words
                        reply.asr_event = self._last_event  # the decode whose words it answers, for the ASR stages
                case turn.ScorePause(pause_id, probability):
                    self.asr.send_score(pause_id, probability)
                case turn.CommitReply(reply_id, user_text, announce):
                    reply = self._replies.get(reply_id)
                    if reply is None:  # its stage failed in the meantime: the turn is over before it began
                        self._apply(self.turns.on_reply_failed(reply_id))
                    else:
                        self._commit(reply, user_text, announce)
                case turn.HoldTurn(user_text):
                    self.outbox.emit(user_final=conversation_pb2.Transcript(text=user_text))
                case turn.PausePlayout():
                    self.playout.pause()
                    log.info("playout paused: speech over the reply", extra={"session_id": self.options.session_id})
                case turn.ResumePlayout(_, reason):
                    telemetry.OVERLAPS.labels(reason).inc()
                    log.info("playout resumed", extra={"session_id": self.options.session_id, "reason": reason})
                    self.playout.resume()
                    if self._current is not None:
                        self._finish_if_played(self._current)
                case turn.Interrupt(reply_id, continued):
                    if self._current is not None and self._current.utterance_id == reply_id:
                        self._interrupt(self._current, continued)
                case turn.EndTurn(reply_id):
                    if self._current is not None and self._current.utterance_id == reply_id:
                        self._end_turn(self._current)
        self._schedule_tick()
        self.asr.urgency(self.turns.waiting_on_words)

    def _schedule_tick(self) -> None:
        """The controller's timers (a paused reply resumes when no words come) run on the event loop's clock."""
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        due_ms = self.turns.next_tick_ms
        if due_ms is not None and not self._closing:
            delay_s = max(0.0, due_ms - _now_ms()) / 1000
            self._tick_handle = asyncio.get_running_loop().call_later(delay_s, self._tick)

    def _tick(self) -> None:
        self._tick_handle = None
        self._apply(self.turns.tick(_now_ms()))

    # ---- replies -------------------------------------------------------------------------------------------
    def _start_reply(self, command: turn.StartReply) -> None:
        event = self._last_event or asr_pb2.RecognizeEvent()
        reply = Reply(command.reply_id, command.user_text, command.speculative)
        # The dialogue as it is now: a reply started on the final is committed at once, and its user line enters
        # the history before the LLM call is made (so it is in the prompt once).
        reply.messages = prompt_messages(self.options.system_prompt, self.history, command.user_text)
        reply.mark("reply_started")
        reply.asr_event = event
        if command.on_partial:
            reply.started = "partial"
        self.recorder.started(reply, event)
        self._replies[reply.utterance_id] = reply
        if command.turn_end is not None:  # a prefill scored these words
            self.recorder.prefill_scored(reply)
            reply.mark("turn_scored")
            reply.turn_end = command.turn_end
        run = ReplyRun(reply, command, self)
        reply.llm_task = asyncio.ensure_future(self.outbox.supervised("llm", run.run))

    def _commit(self, reply: Reply, user_text: str, announce: bool = True) -> None:
        """The user's turn is final: the reply becomes the current one and may be heard."""
        if announce:
            self.outbox.emit(user_final=conversation_pb2.Transcript(text=user_text))
        self.recorder.committed(reply, self._last_event or asr_pb2.RecognizeEvent())
        reply.committed = True
        reply.confirmed.set()
        reply.mark("committed")
        reply.turn_index = self.outbox.turn_index
        self.outbox.turn_index += 1
        self.history.append(HistoryEntry("user", user_text))
        self.entries.note(reply.turn_index, self.history[-1])
        self._current = reply
        self._idle.clear()
        if reply.text:
            self.outbox.emit(
                reply_text=conversation_pb2.ReplyText(text_delta="".join(reply.text)), turn=reply.turn_index
            )
        self.release(reply)

    def _discard(self, reply: Reply) -> None:
        """A speculative reply was overtaken: never spoken, never in history."""
        self._cancel_reply(reply)
        self.recorder.discarded_reply(reply)

    def _cancel_reply(self, reply: Reply) -> None:
        if reply.cancelled:
            return
        reply.cancelled = True
        telemetry.CANCELLATIONS.inc()
        reply.frames.clear()
        if reply.llm_task is not None and not reply.llm_task.done():
            reply.llm_task.cancel()
        self.tts.cancel(reply)
        self._replies.pop(reply.utterance_id, None)

    def fail(self, reply: Reply) -> None:
        """A stage failed mid-reply: the turn ends without (the rest of) its audio; the controller decides."""
        self._cancel_reply(reply)
        self._apply(self.turns.on_reply_failed(reply.utterance_id))

    def _interrupt(self, reply: Reply, continued: bool = False) -> None:
        """`continued`: none of the reply was heard and the user's speech continues the turn it answered, whose
        words leave the history (the next commit carries them)."""
        dropped = self._flush_playout(reply)  # first: what was heard ends here
        spoken = " ".join(reply.spoken_chunks)
        self._cancel_reply(reply)
        self.recorder.interrupted(reply, spoken, dropped, continued)
        self.outbox.emit(
            interrupted=conversation_pb2.Interrupted(spoken_text=spoken, continued=continued), turn=reply.turn_index
        )
        if continued and not spoken and self.history and self.history[-1].role == "user":
            self.history.pop()  # the turn this one continues: the next commit has its words
        self._end_turn(reply, interrupted=True)

    def _end_turn(self, reply: Reply, interrupted: bool = False) -> None:
        """History gets what was said aloud (marked when cut short); the turn's metrics go out; back to listening.

        Audio of the reply not played yet (a failed stage ends the turn too) is dropped."""
        self._flush_playout(reply)
        self._replies.pop(reply.utterance_id, None)
        text = " ".join(reply.spoken_chunks)
        if text:
            self.history.append(HistoryEntry("assistant", text, interrupted))
            self.entries.note(reply.turn_index, self.history[-1])
        if self.history_max_chars:
            trim_history(self.history, self.history_max_chars)
        tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens  # the next prompt, but for its question
        if self.history_max_tokens and tokens > self.history_max_tokens:
            drop_oldest(self.history, sum(len(entry.text) for entry in self.history) // 2)
        self.recorder.ended(reply)
        self._current = None
        self._idle.set()

    # ---- playout -------------------------------------------------------------------------------------------
    def release(self, reply: Reply) -> None:
        """Hand the committed reply's frames to the playout as they come (all at once for `buffer_whole_reply`)."""
        if reply is not self._current or reply.cancelled:
            return  # speculative: held until it is committed, or dropped
        if self.pipeline.buffer_whole_reply and not reply.tts_done:
            return
        while reply.frames:
            speech = reply.frames.popleft()
            more = speech.chunk_index > 0 and speech.HasField("timing")  # a later chunk's first frame
            self.playout.push(ReplyFrame(reply.turn_index, reply.frames_released, speech), more)
            reply.frames_released += 1
        self._finish_if_played(reply)

    def retract(self, reply: Reply) -> None:
        """The TTS stream broke off: the current reply's frames of its unfinished chunk leave the playout's queue."""
        if reply is self._current:
            turn_index = reply.turn_index
            taken = self.playout.retract(lambda frame: frame.turn_index == turn_index and not frame.speech.chunk_end)
            reply.frames_released -= taken

    def ahead_s(self, reply: Reply) -> float | None:
        """The current reply's audio its listener has left (None for any other reply, or while paused)."""
        return self.playout.ahead_s() if reply is self._current else None

    def _flush_playout(self, reply: Reply) -> int:
        """End the reply's playout, dropping what is queued; returns how many frames."""
        self.recorder.playout_ends(reply, self.playout)
        return self.playout.flush()

    def _played(self, frame: ReplyFrame, sent_us: int) -> None:
        """The transport sent a frame: it was heard, so its text counts as spoken (history, `interrupted`)."""
        reply = self._current
        if reply is None or reply.turn_index != frame.turn_index:
            return  # it was on its way when its reply ended
        if reply.frames_sent == 0:
            reply.mark("first_audio_sent", sent_us)
            reply.first_sent_us = sent_us
        reply.frames_sent += 1
        if frame.speech.chunk_end:
            if self.heard_on_confirmation:
                reply.unconfirmed_chunks += 1
            else:
                self._heard(reply, frame.speech.text)
        self._finish_if_played(reply)

    def confirm_heard(self, turn_index: int, text: str, heard: bool = True) -> None:
        """The listener's word on a chunk whose last frame was sent (`heard_on_confirmation`): heard, its text counts
        as spoken; not heard (no word came in time), the reply stops waiting for it. Late word of an ended turn is
        ignored."""
        reply = self._current
        if reply is None or reply.turn_index != turn_index or not reply.unconfirmed_chunks:
            return
        reply.unconfirmed_chunks -= 1
        if heard:
            self._heard(reply, text)
        self._finish_if_played(reply)

    def _heard(self, reply: Reply, text: str) -> None:
        reply.spoken_chunks.append(text)
        self.turns.on_words_heard(reply.utterance_id)

    def _finish_if_played(self, reply: Reply) -> None:
        """The reply is done once all of it was generated, synthesized and played (a paused one waits for its
        resume: the speech over it may yet interrupt it)."""
        if reply is not self._current or reply.cancelled or self.turns.paused:
            return
        if not (reply.llm_done and reply.tts_done) or reply.frames or self.playout.queued or reply.unconfirmed_chunks:
            return
        self.outbox.emit(
            reply_done=conversation_pb2.ReplyDone(text=" ".join(reply.spoken_chunks)), turn=reply.turn_index
        )
        self._apply(self.turns.on_reply_done(reply.utterance_id))
