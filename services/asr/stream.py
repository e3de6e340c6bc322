"""One recognition stream: frames in, VAD turn events and transcripts out, decodes scheduled on a shared pool."""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable, Coroutine

import numpy as np

from services.asr.completeness import TurnScorer, doubted
from services.asr.endpointing import Endpointer, EndpointingPolicy, Event
from services.asr.engine import DecodeOptions, Transcriber, Transcript
from services.asr.stabilizer import LocalAgreement
from services.asr.vad import SAMPLE_RATE_HZ, WINDOW_MS, WINDOW_SAMPLES, Vad
from voicemesh import telemetry
from voicemesh.audio import StreamResampler, pcm16_to_float
from voicemesh.endpointing import INCOMPLETE_AT, lm_completeness
from voicemesh.v1 import asr_pb2, audio_pb2
from voicemesh.workers import Timed, WorkerPool

log = logging.getLogger(__name__)
TRACER = telemetry.tracer(__name__)

FINAL_PRIORITY = 0
DECISION_PARTIAL_PRIORITY = 5  # a partial a decision waits on (barge-in): after finals, before every caption
PARTIAL_PRIORITY = 10
PREROLL_MS = 200  # audio kept before the detected speech start (VAD needs a few windows to fire)
MAX_TURN_S = 28  # Whisper's window is 30 s; a longer monologue is committed in pieces


class RecognitionStream:
    """State of one StreamingRecognize call. `emit` receives events in the order they are ready."""

    def __init__(
        self,
        config: asr_pb2.RecognitionConfig,
        policy: EndpointingPolicy,
        vad: Vad,
        transcriber: Transcriber,
        pool: WorkerPool,
        emit: Callable[[asr_pb2.RecognizeEvent], None],
        scorer: TurnScorer | None = None,
        fail: Callable[[BaseException], None] | None = None,
        partials: tuple[Transcriber, WorkerPool] | None = None,
    ) -> None:
        self.config = config
        capabilities = transcriber.capabilities
        # An engine without a trimmed decode always decodes its full window (slower, same text).
        trimmed = config.decode_window != asr_pb2.DECODE_WINDOW_FULL and capabilities.trimmed_decode
        language = capabilities.language_for(config.language)
        word_timings = capabilities.word_timings and not config.skip_word_timings  # else finals carry no words
        weighs_end = scorer is not None and scorer.learned is not None and "whisper_end" in scorer.learned.features
        self._final_options = DecodeOptions(language, trimmed, word_timings, end_probability=weighs_end)
        self._partial_options = DecodeOptions(language, capabilities.trimmed_decode, word_timings=False)
        self.partial_interval_ms = config.partial_interval_ms or 200
        self.progress_interval_ms = config.progress_interval_ms  # 0: no Progress events
        self._vad = vad
        self._endpointer = Endpointer(policy, WINDOW_MS, awaits_scores=config.turn_scores and scorer is not None)
        self._transcriber = transcriber
        self._pool = pool
        # Partials (captions, not on anyone's critical path) may have a model and threads of their own, at a lower
        # priority; by default they share the drafts' and finals' model and pool, behind them.
        self._partial_transcriber, self._partial_pool = partials or (transcriber, pool)
        self.partial_urgency: int = asr_pb2.PARTIAL_URGENCY_CAPTIONS
        self._emit = emit
        self._fail = fail  # a decode or score that raised ends the call (else the turn would be lost in silence)
        self._resampler = StreamResampler(config.sample_rate_hz, SAMPLE_RATE_HZ)
        self._pending = np.zeros(0, dtype=np.float32)  # resampled samples not yet in a VAD window
        self._audio = np.zeros(0, dtype=np.float32)  # recent audio, 16 kHz
        self._audio_start = 0  # absolute sample index of self._audio[0]
        self._received_ms = 0.0
        self._frames = 0
        self._progress_ms = 0.0  # audio received at the last Progress event
        self._frame_ends_ms: list[float] = []  # audio end of each recent frame, for capture-time lookup
        self._frame_capture_us: list[int] = []
        self.turn_index = 0
        self._stabilizer = LocalAgreement()
        self._loudness = Loudness()
        self._scorer = None if policy.fixed_hangover else scorer
        self._audio_score: tuple[int, float] | None = None  # the audio model's score of the newest pause scored
        self._audio_scoring: set[int] = set()  # pauses whose audio score is being computed
        self._parked: asr_pb2.TurnScore | None = None  # a language model's score waiting for that audio score
        self._score_ms: dict[int, float] = {}  # pause id -> time its completeness score took
        self._pause_started_ns = 0  # when the open pause's first silent window was seen
        self._last_partial_ms = 0
        self._partial_task: asyncio.Task[None] | None = None
        self._draft: asyncio.Future[Timed[Transcript]] | None = None
        self._draft_offset_ms = 0
        # Done once the newest committed turn's final is sent (or its decode failed). Decodes run side by side in the
        # pool and finish in any order; every final waits for the one before it, and every transcript of a turn
        # (partial, candidate) for the final of the turn before, so events come in the order of the audio.
        self._final_sent: asyncio.Future[None] | None = None
        self._committed_end_ms = 0  # the end of the last committed turn's speech: no later turn's audio starts before
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def in_turn(self) -> bool:
        """Inside an utterance: its speech has started and its end is not committed yet (its final is to come)."""
        return self._endpointer.in_turn

    # ---- input -----------------------------------------------------------------------------------------
    def push_frame(self, frame: audio_pb2.AudioFrame) -> None:
        samples = self._resampler.process(pcm16_to_float(frame.data))
        frame_ms = len(frame.data) / 2 * 1000 / self.config.sample_rate_hz
        self._received_ms += frame_ms
        self._frames += 1
        telemetry.AUDIO.labels("asr").inc(frame_ms / 1000)
        self._frame_ends_ms.append(self._received_ms)
        self._frame_capture_us.append(frame.capture_time_us)
        if len(self._frame_ends_ms) > 2000:  # 40 s of 20 ms frames is far more than any endpoint looks back
            del self._frame_ends_ms[:1000], self._frame_capture_us[:1000]
        self._audio = np.concatenate([self._audio, samples])
        self._pending = np.concatenate([self._pending, samples])
        while len(self._pending) >= WINDOW_SAMPLES:
            window, self._pending = self._pending[:WINDOW_SAMPLES], self._pending[WINDOW_SAMPLES:]
            quiet = self._loudness.quiet(window)
            for event in self._endpointer.push(self._vad.probability(self._loudness.normalize(window)), quiet):
                self._on_vad(event)
            self._cut_long_turn()
        self._maybe_partial()
        self._trim_audio()
        if self.progress_interval_ms and self._received_ms - self._progress_ms >= self.progress_interval_ms:
            self._progress_ms = self._received_ms
            self._send(asr_pb2.RecognizeEvent(progress=asr_pb2.Progress()))

    def _cut_long_turn(self) -> None:
        ep = self._endpointer
        if ep.in_turn and ep.now_ms - ep.speech_start_ms >= MAX_TURN_S * 1000 and not ep.candidate:
            log.info("turn too long; committing it", extra={"session_id": self.config.session_id})
            self._start_draft()
            ep.end_turn()
            self._commit()

    def _on_vad(self, event: Event) -> None:
        ep = self._endpointer
        if event is Event.SPEECH_STARTED:
            self._stabilizer.reset()
            self._last_partial_ms = ep.now_ms
            self._send(asr_pb2.RecognizeEvent(speech_started=asr_pb2.SpeechStarted()))
        elif event is Event.SPEECH_STOPPED:
            self._pause_started_ns = time.monotonic_ns()
            self._send(asr_pb2.RecognizeEvent(speech_stopped=asr_pb2.SpeechStopped()))
            if not self.config.final_after_end_of_turn:
                self._start_draft()
            self._start_score()
        elif event is Event.ENDPOINT_CANDIDATE:
            if self._draft is None:
                self._start_draft()
            self._announce_candidate()
        elif event is Event.SPEECH_RESUMED:
            self._draft = None
            self._send(asr_pb2.RecognizeEvent(speech_resumed=asr_pb2.SpeechResumed()))
        elif event is Event.END_OF_TURN:
            if self._draft is None or self.config.final_after_end_of_turn:
                self._start_draft()
            self._commit()

    def _start_score(self) -> None:
        """Score how complete the utterance is at this pause: the audio now, the transcript once the draft is in.
        The score picks the pause's hangover; a score that fails or comes late leaves the fixed hangover."""
        if self._scorer is None:
            return
        scorer, endpointer, draft = self._scorer, self._endpointer, self._draft
        pause_id = endpointer.pause_id
        audio, _ = self._turn_audio()
        started_ns = time.monotonic_ns()
        if scorer.audio_model is not None:
            self._audio_scoring.add(pause_id)

        async def score() -> None:
            try:
                try:
                    audio_score = await scorer.audio_score(audio)
                finally:
                    self._audio_scoring.discard(pause_id)
                if audio_score is not None:
                    self._audio_score = (pause_id, audio_score)
                self._unpark(pause_id)
                text = (await draft).result.text if draft is not None else ""
                completeness = scorer.fuse(audio_score, text)
            except Exception:
                log.exception("completeness score failed", extra={"session_id": self.config.session_id})
                telemetry.TURN_SCORES.labels("failed").inc()
                self._unpark(pause_id)
                return
            elapsed_ms = (time.monotonic_ns() - started_ns) / 1e6
            telemetry.COMPUTE.labels("asr_turn_score").observe(elapsed_ms / 1000)
            if completeness is None:
                return
            live = endpointer.pause_id == pause_id and endpointer.in_turn
            telemetry.TURN_SCORES.labels("in_time" if live else "late").inc()
            self._score_ms.setdefault(pause_id, elapsed_ms)  # a language model's score, if in first, counts
            for event in endpointer.score(pause_id, completeness):
                self._on_vad(event)

        self._spawn(score())

    def turn_score(self, score: asr_pb2.TurnScore) -> None:
        """A language model's P(the turn ends at pause `score.pause_id`), from the client (the gateway asks the
        LLM as it starts the speculative reply to the endpoint candidate). It decides the pause's hangover; one
        that comes after the pause ended is counted late and dropped. With `config.turn_scores` every pause waits
        for one, up to the policy's score budget; a `declined` one ends that wait."""
        if self._scorer is None:
            return  # fixed hangover: nothing is scored
        endpointer = self._endpointer
        live = endpointer.pause_id == score.pause_id and endpointer.in_turn
        if score.declined:
            for event in endpointer.decline(score.pause_id):
                self._on_vad(event)
            return
        telemetry.TURN_SCORES.labels("in_time" if live else "late").inc()
        if not live:
            return
        elapsed_ms = (time.monotonic_ns() - self._pause_started_ns) / 1e6
        telemetry.COMPUTE.labels("asr_turn_score_lm").observe(elapsed_ms / 1000)
        self._score_ms[score.pause_id] = elapsed_ms
        learned = self._scorer.learned
        if learned is not None and learned.uses_audio and score.pause_id in self._audio_scoring:
            # The fusion weighs the audio model's score, which is on its way: the pause waits for it (within the
            # score budget, as it waited for this score), so the fused score, not this one alone, decides.
            self._parked = score
            return
        self._apply_turn_score(score)

    def _unpark(self, pause_id: int) -> None:
        """The audio score of `pause_id` is in (or failed): decide the pause on a language model's score parked
        for it."""
        parked = self._parked
        if parked is not None and parked.pause_id == pause_id:
            self._parked = None
            self._apply_turn_score(parked)

    def _apply_turn_score(self, score: asr_pb2.TurnScore) -> None:
        assert self._scorer is not None
        completeness = lm_completeness(score.probability)
        draft = self._draft
        if draft is not None and draft.done() and not draft.cancelled() and draft.exception() is None:
            transcript = draft.result().result
            audio = self._audio_score
            audio_score = audio[1] if audio is not None and audio[0] == score.pause_id else None
            completeness = self._scorer.with_language_model(transcript, score.probability, audio_score)
            # The ASR's own doubt vetoes a finished-sounding score: a line ending in a filler (the speaker is
            # thinking), only fillers, a garbled decode or no speech at all never takes the short wait.
            reason = doubted(transcript)
            if reason is not None:
                telemetry.TURN_SCORES_VETOED.labels(reason).inc()
                completeness = min(completeness, INCOMPLETE_AT)
        for event in self._endpointer.score(score.pause_id, completeness, decisive=True):
            self._on_vad(event)

    def set_urgency(self, urgency: asr_pb2.Urgency) -> None:
        """The client says who waits on this stream's partials from now on (see PartialUrgency)."""
        self.partial_urgency = urgency.partials or asr_pb2.PARTIAL_URGENCY_CAPTIONS

    # ---- decodes ---------------------------------------------------------------------------------------
    def _turn_audio(self) -> tuple[np.ndarray, int]:
        """The turn's audio (with pre-roll) and its offset in the stream, in milliseconds. The pre-roll never reaches
        back into the turn before: speech that goes on soon after a commit would have its decode hear the committed
        words' end again, and a turn that continues the one before would repeat them (issue 40)."""
        from_ms = max(self._endpointer.speech_start_ms - PREROLL_MS, self._committed_end_ms)
        start = max(self._audio_start, from_ms * SAMPLE_RATE_HZ // 1000)
        return self._audio[start - self._audio_start :].copy(), start * 1000 // SAMPLE_RATE_HZ

    def _start_draft(self) -> None:
        """Final decode of the turn so far, started at the first silent window so it is ready at the endpoint.

        Silence inside a sentence starts drafts too; one that speech overtakes is shown as a partial instead.
        """
        audio, offset_ms = self._turn_audio()
        draft = asyncio.ensure_future(
            self._pool.run(
                self._transcriber.transcribe,
                audio,
                self._final_options,
                priority=FINAL_PRIORITY,
            )
        )
        self._draft = draft
        self._draft_offset_ms = offset_ms
        self._last_partial_ms = self._endpointer.now_ms
        turn, after = self.turn_index, self._final_sent

        async def as_partial() -> None:
            result = await draft
            await _sent(after)
            overtaken = self._draft is not draft and self.turn_index == turn and self._endpointer.in_turn
            if overtaken and result.result.text and self.config.interim_results:
                stable = self._stabilizer.update(result.result.text)
                partial = asr_pb2.Partial(text=result.result.text, stable_prefix=stable)
                self._send(asr_pb2.RecognizeEvent(partial=partial), timing_from=result)

        self._spawn(as_partial())

    def _announce_candidate(self) -> None:
        draft = self._draft
        assert draft is not None
        offset_ms = self._draft_offset_ms
        turn = self.turn_index
        pause_id = self._endpointer.pause_id
        stamp = self._stamp()
        after = self._final_sent

        async def announce() -> None:
            result = await draft
            await _sent(after)
            if self._draft is draft and self.turn_index == turn and self._endpointer.candidate:
                candidate = asr_pb2.EndpointCandidate(
                    text=result.result.text, words=_words(result.result, offset_ms), pause_id=pause_id
                )
                self._send(asr_pb2.RecognizeEvent(endpoint_candidate=candidate), stamp, result)

        self._spawn(announce())

    def _commit(self) -> None:
        draft = self._draft
        assert draft is not None
        offset_ms = self._draft_offset_ms
        stamp = self._stamp()
        ep = self._endpointer
        completeness = -1.0 if ep.completeness is None else ep.completeness
        hangover_ms, score_ms = ep.hangover_ms, self._score_ms.pop(ep.pause_id, 0.0)
        self._score_ms.clear()
        self.turn_index += 1
        self._committed_end_ms = ep.speech_end_ms
        self._draft = None
        self._stabilizer.reset()
        after, sent = self._final_sent, asyncio.get_running_loop().create_future()
        self._final_sent = sent

        async def finish() -> None:
            try:
                result = await draft
                await _sent(after)  # the turn before's final first, whichever decode finished first
                final = asr_pb2.Final(
                    text=result.result.text,
                    words=_words(result.result, offset_ms),
                    language=result.result.language,
                    completeness=completeness,
                    hangover_ms=hangover_ms,
                    score_ms=score_ms,
                )
                self._send(asr_pb2.RecognizeEvent(final=final), stamp, result)
            finally:
                if not sent.done():
                    sent.set_result(None)  # a failed decode ends the call; the finals after it are not held forever

        self._spawn(finish())

    def _maybe_partial(self) -> None:
        ep = self._endpointer
        if not (self.config.interim_results and ep.in_turn and not ep.candidate):
            return
        if ep.now_ms - self._last_partial_ms < self.partial_interval_ms:
            return
        if self._partial_task is not None and not self._partial_task.done():
            return  # one partial in flight per stream
        if self._draft is not None and not self._draft.done():
            return  # a draft in flight will serve as the partial
        if self.partial_urgency == asr_pb2.PARTIAL_URGENCY_DECISION:
            # A decision waits on its words: the finals' model and workers, behind finals only, never shed.
            transcriber, pool, priority = self._transcriber, self._pool, DECISION_PARTIAL_PRIORITY
        elif self._partial_pool.waiting:
            return  # captions are optional: shed them when decodes are queueing
        else:
            transcriber, pool, priority = self._partial_transcriber, self._partial_pool, PARTIAL_PRIORITY
        self._last_partial_ms = ep.now_ms
        audio, _ = self._turn_audio()
        turn, after = self.turn_index, self._final_sent

        async def partial() -> None:
            result = await pool.run(transcriber.transcribe, audio, self._partial_options, priority=priority)
            await _sent(after)
            text = result.result.text
            if self.turn_index != turn or not text or not self._endpointer.in_turn:
                return
            stable = self._stabilizer.update(text)
            partial = asr_pb2.Partial(text=text, stable_prefix=stable)
            self._send(asr_pb2.RecognizeEvent(partial=partial), timing_from=result)

        self._partial_task = self._spawn(partial())

    # ---- plumbing --------------------------------------------------------------------------------------
    def _stamp(self) -> asr_pb2.RecognizeEvent:
        """The turn and where its speech is now, for an event sent now or later (after a decode)."""
        ep = self._endpointer
        return asr_pb2.RecognizeEvent(
            turn_index=self.turn_index,
            speech_start_ms=ep.speech_start_ms,
            speech_end_ms=ep.speech_end_ms,
            speech_end_capture_time_us=self._capture_time_at(ep.speech_end_ms),
        )

    def _capture_time_at(self, audio_ms: float) -> int:
        index = bisect.bisect_left(self._frame_ends_ms, audio_ms - 0.5)
        if not self._frame_capture_us:
            return 0
        return self._frame_capture_us[min(index, len(self._frame_capture_us) - 1)]

    def _send(
        self,
        event: asr_pb2.RecognizeEvent,
        stamp: asr_pb2.RecognizeEvent | None = None,
        timing_from: Timed[Transcript] | None = None,
    ) -> None:
        """Send `event`, stamped (now, unless a stamp taken earlier is given) with the decode's timing."""
        message = stamp or self._stamp()
        message.MergeFrom(event)
        message.audio_received_ms = int(self._received_ms)
        message.frames_received = self._frames
        if timing_from is not None:
            message.timing.queue_ms = timing_from.queue_ms
            message.timing.compute_ms = timing_from.compute_ms
            message.decode_done_us = timing_from.result.done_us
            if (kind := event.WhichOneof("event")) in ("final", "endpoint_candidate"):
                telemetry.QUEUE_WAIT.labels("asr").observe(timing_from.queue_ms / 1000)
                telemetry.COMPUTE.labels("asr").observe(timing_from.compute_ms / 1000)
                message.traceparent = self._decode_span(kind or "", timing_from)
        self._emit(message)

    def _decode_span(self, kind: str, timed: Timed[Transcript]) -> str:
        """This process's span of a decode a turn may wait on (its own trace: the turn's starts later, at the commit);
        returns its traceparent, which the gateway links the turn's span to."""
        done_ns = timed.result.done_us * 1000 or time.time_ns()
        started_ns = done_ns - int(timed.compute_ms * 1e6)
        span = TRACER.start_span(
            "asr.decode",
            start_time=started_ns - int(timed.queue_ms * 1e6),
            attributes={"session.id": self.config.session_id, "event": kind, "queue_ms": timed.queue_ms},
        )
        span.end(end_time=done_ns)
        return telemetry.traceparent_of(span)

    def _spawn(self, coro: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("recognition task failed", extra={"session_id": self.config.session_id, "error": repr(error)})
        telemetry.ERRORS.labels("asr", "INTERNAL").inc()
        if self._fail is not None and error is not None:
            self._fail(error)

    def _trim_audio(self) -> None:
        """Keep only what a turn can still need: the current turn, or the last preroll when idle."""
        if self._endpointer.in_turn or self._draft is not None:
            keep_from = max(0, (self._endpointer.speech_start_ms - PREROLL_MS) * SAMPLE_RATE_HZ // 1000)
        else:
            keep_from = self._audio_start + len(self._audio) - PREROLL_MS * SAMPLE_RATE_HZ // 1000
        cut = keep_from - self._audio_start
        if cut > SAMPLE_RATE_HZ:  # trim in >= 1 s steps to keep copying cheap
            self._audio = self._audio[cut:]
            self._audio_start += cut

    def finish_input(self) -> None:
        """The client closed its side: a turn still open is committed with the audio there is, and every frame
        received is acknowledged."""
        if self._endpointer.in_turn:
            if self._draft is None:
                self._start_draft()
            self._endpointer.end_turn()
            self._commit()
        if self.progress_interval_ms:
            self._send(asr_pb2.RecognizeEvent(progress=asr_pb2.Progress()))

    async def drain(self) -> None:
        """Wait for decodes in flight."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class Loudness:
    """Tracks the speaker's level (a peak that decays about 6 dB per second, so a louder earlier turn does not
    mute a softer one), and makes end-of-speech detection independent of it:
    - `quiet`: a window 35 dB under the speaker's level is silence, whatever the VAD says;
    - `normalize`: the VAD hears every speaker at the same level, a distant or quiet one turned up by as much as
      MAX_GAIN_DB (Silero misses speech at -50 dBFS that it finds at -20), a loud one turned down. Silero's
      probabilities, and so where it hears speech stop, depend on the level it is fed: unnormalized, the same
      sentence 20 dB quieter ended a window earlier or later and 40 dB quieter broke into five pieces.
    """

    QUIET_BELOW_DB = 35.0
    FLOOR_DBFS = -100.0  # only digital silence is quiet by level alone (a -40 dB speaker's tail is above it)
    DECAY_DB_PER_WINDOW = 0.2
    TARGET_DBFS = -20.0
    MAX_GAIN_DB = 40.0  # speech down to -60 dBFS is heard as at -20
    MAX_CUT_DB = 20.0  # speech up to 0 dBFS (a close, hot microphone) is heard as at -20

    def __init__(self) -> None:
        self.level_dbfs = -120.0

    def quiet(self, window: np.ndarray) -> bool:
        """Updates the level with this window; call it before `normalize`."""
        dbfs = 10 * float(np.log10(np.mean(window.astype(np.float64) ** 2) + 1e-12))
        self.level_dbfs = max(dbfs, self.level_dbfs - self.DECAY_DB_PER_WINDOW)
        return dbfs < max(self.FLOOR_DBFS, self.level_dbfs - self.QUIET_BELOW_DB)

    def normalize(self, window: np.ndarray) -> np.ndarray:
        gain_db = min(self.MAX_GAIN_DB, max(-self.MAX_CUT_DB, self.TARGET_DBFS - self.level_dbfs))
        if gain_db == 0.0:
            return window
        return np.clip(window * np.float32(10 ** (gain_db / 20)), -1.0, 1.0)


async def _sent(final: asyncio.Future[None] | None) -> None:
    """Wait until `final` (an earlier turn's final) is sent; at once when it is. Cancelling the wait leaves it be."""
    if final is not None and not final.done():
        await asyncio.wait({final})


def _words(transcript: Transcript, offset_ms: int) -> list[asr_pb2.Word]:
    return [
        asr_pb2.Word(
            text=w.text,
            start_ms=offset_ms + int(w.start_s * 1000),
            end_ms=offset_ms + int(w.end_s * 1000),
            probability=w.probability,
        )
        for w in transcript.words
    ]
