"""A turn must never end without its reply (issue 40): the last sound of a word, heard after a language model's score
committed the turn in its short wait, is not a turn of its own.

`voicemesh loadtest` lost a plain finished sentence's reply ("That is true") with nobody speaking over it. The ASR,
replayed offline and against the service on "Turn off the kitchen lights." (Piper) with the LLM's score 0.9 sent back
at the pause after "light": the turn committed as "turn off the kitchen light" 64 ms into the pause, then the "s"
(128 ms after the vowel, 160 ms long) opened turn 1, whose decode, its pre-roll reaching back into "light", heard
"states". At the gateway that is a word over a reply none of whose words were heard: the reply is interrupted as a
continued turn (no audio: NO_AUDIO in the load test) and the user's line becomes "turn off the kitchen light states".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from services.asr.completeness import TurnScorer
from services.asr.endpointing import TAIL_GAP_MS, TAIL_MIN_SPEECH_MS, Endpointer, EndpointingPolicy, Event
from services.asr.engine import DecodeOptions, TranscriberCapabilities, Transcript
from services.asr.stream import PREROLL_MS, RecognitionStream
from services.asr.vad import WINDOW_SAMPLES
from tests.unit.fake_asr import FakeScriptedVad
from voicemesh.v1 import asr_pb2, audio_pb2
from voicemesh.workers import Timed, WorkerPool

WINDOW_MS = 32
POLICY = EndpointingPolicy()  # the gateway's: the LLM's score of a pause decides its wait, 64 ms when sure


def _windows(ms: int) -> int:
    return ms // WINDOW_MS


def _commit_after_a_sure_score(endpointer: Endpointer, speech_windows: int) -> list[Event]:
    """Speech, then the pause's first silent windows and the LLM's decisive 'finished' score: committed."""
    events = []
    for _ in range(speech_windows):
        events += endpointer.push(0.9)
    for _ in range(_windows(POLICY.min_hangover_ms)):
        events += endpointer.push(0.0)
        events += endpointer.score(endpointer.pause_id, 0.95, decisive=True)
    assert Event.END_OF_TURN in events and not endpointer.in_turn
    return events


def test_the_last_sound_of_a_word_after_the_commit_opens_no_turn() -> None:
    endpointer = Endpointer(POLICY, WINDOW_MS, awaits_scores=True)
    _commit_after_a_sure_score(endpointer, 32)
    # The "s" of "lights": 160 ms of speech 128 ms after the vowel, then silence.
    events = []
    for _ in range(_windows(128) - _windows(POLICY.min_hangover_ms)):
        events += endpointer.push(0.0)
    for _ in range(_windows(160)):
        events += endpointer.push(0.9)
    for _ in range(20):
        events += endpointer.push(0.0)
    assert Event.SPEECH_STARTED not in events, events


def test_the_user_going_on_soon_after_the_commit_is_a_turn_from_where_the_speech_started() -> None:
    endpointer = Endpointer(POLICY, WINDOW_MS, awaits_scores=True)
    _commit_after_a_sure_score(endpointer, 32)
    committed_end = endpointer.speech_end_ms
    events = []
    for _ in range(_windows(128) - _windows(POLICY.min_hangover_ms)):
        events += endpointer.push(0.0)
    start = endpointer.now_ms
    for _ in range(_windows(TAIL_MIN_SPEECH_MS) + 1):
        events += endpointer.push(0.9)
    assert events.count(Event.SPEECH_STARTED) == 1
    assert endpointer.speech_start_ms == start and start - committed_end < TAIL_GAP_MS


def test_speech_well_after_the_commit_opens_a_turn_as_soon_as_ever() -> None:
    endpointer = Endpointer(POLICY, WINDOW_MS, awaits_scores=True)
    _commit_after_a_sure_score(endpointer, 32)
    for _ in range(_windows(TAIL_GAP_MS) + 2):
        endpointer.push(0.0)
    events = []
    for _ in range(_windows(POLICY.min_speech_ms)):
        events += endpointer.push(0.9)
    assert events == [Event.SPEECH_STARTED]


# ---- the stream: a turn's decode never hears the turn before it --------------------------------------------------
TONE = (0.1 * np.sin(np.arange(WINDOW_SAMPLES) * 0.3) * 32767).astype("<i2").tobytes()


class FakeTranscriber:
    name = "fake"
    capabilities = TranscriberCapabilities(
        languages=frozenset({"en"}), detects_language=False, trimmed_decode=True, word_timings=False
    )

    def transcribe(self, audio: np.ndarray, options: DecodeOptions | None = None) -> Transcript:
        return Transcript(text="words.", language="en")


class FakeRecordingPool(WorkerPool):
    """Decodes at once, noting how much audio each decode was given."""

    def __init__(self) -> None:
        super().__init__(1, "test-asr")
        self.lengths: list[int] = []

    async def run(self, fn: Callable[..., Any], *args: Any, priority: int = 0) -> Timed[Any]:
        self.lengths.append(len(args[0]))
        return Timed(fn(*args), 0.0, 1.0)


async def test_a_turn_right_after_a_commit_decodes_none_of_the_committed_turns_audio() -> None:
    # A turn committed by the LLM's sure score 64 ms into its pause; the user goes on 96 ms after its last speech.
    gap, speech = _windows(96), _windows(480)
    vad = FakeScriptedVad([(True, 32), (False, gap), (True, speech), (False, 60)])
    pool = FakeRecordingPool()
    events: list[asr_pb2.RecognizeEvent] = []
    streams: list[RecognitionStream] = []

    def emit(event: asr_pb2.RecognizeEvent) -> None:  # the gateway: the LLM scores each candidate "finished"
        events.append(event)
        if event.WhichOneof("event") == "endpoint_candidate":
            score = asr_pb2.TurnScore(pause_id=event.endpoint_candidate.pause_id, probability=0.9)
            asyncio.get_running_loop().call_soon(streams[0].turn_score, score)

    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000, turn_scores=True)
    streams.append(RecognitionStream(config, POLICY, vad, FakeTranscriber(), pool, emit, TurnScorer(None)))
    stream = streams[0]
    for seq in range(32 + gap + speech + 60):
        stream.push_frame(audio_pb2.AudioFrame(data=TONE, seq=seq, sample_rate_hz=16000))
        for _ in range(5):  # the decodes and the score come back before the next window, as in real time
            await asyncio.sleep(0)
    await asyncio.wait_for(stream.drain(), 5)
    finals = [e for e in events if e.WhichOneof("event") == "final"]
    assert len(finals) == 2, [e.WhichOneof("event") for e in events]
    first, second = finals
    assert first.final.hangover_ms == POLICY.min_hangover_ms
    assert second.speech_start_ms - first.speech_end_ms == 96 < PREROLL_MS  # a full pre-roll reaches into turn 0
    # Turn 1's final decode (started at its first silent window) hears from turn 0's last speech on, no earlier.
    heard_ms = pool.lengths[-1] * 1000 // 16000
    assert heard_ms <= second.speech_end_ms + WINDOW_MS - first.speech_end_ms, (heard_ms, first, second)
