"""Finals come in the order of the audio, whichever of their decodes finishes first (issue 40: `voicemesh
transcribe --fast` once printed a recording's second phrase before its first)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from services.asr.endpointing import EndpointingPolicy
from services.asr.engine import DecodeOptions, TranscriberCapabilities, Transcript
from services.asr.stream import RecognitionStream
from services.asr.vad import WINDOW_SAMPLES
from tests.unit.fake_asr import FakeScriptedVad
from voicemesh.v1 import asr_pb2, audio_pb2
from voicemesh.workers import Timed, WorkerPool

TONE = (0.1 * np.sin(np.arange(WINDOW_SAMPLES) * 0.3) * 32767).astype("<i2").tobytes()
# Three phrases, each followed by a pause longer than the fixed hangover (8 windows of 32 ms): three turns.
SCRIPT = [(True, 30), (False, 14), (True, 12), (False, 14), (True, 20), (False, 14)]
PHRASES = ["The first phrase is the longest one.", "A short one.", "And the third."]
TRANSCRIPTS = ("partial", "endpoint_candidate", "final")


class FakeTranscriber:
    """Never called: the pool below decides what each decode heard."""

    name = "fake"
    capabilities = TranscriberCapabilities(
        languages=frozenset({"en"}), detects_language=False, trimmed_decode=True, word_timings=False
    )

    def transcribe(self, audio: np.ndarray, options: DecodeOptions | None = None) -> Transcript:
        raise AssertionError("decoded outside the pool")


class FakeOutOfOrderPool(WorkerPool):
    """Decodes run side by side; the decode of the first turn is handed back only when `release` is set, so the
    later turns' decodes finish first (as a long phrase's decode does beside a short one's, in `--fast`)."""

    def __init__(self, heard: Callable[[np.ndarray], str]) -> None:
        super().__init__(2, "test-asr")
        self.release = asyncio.Event()
        self.heard = heard
        self.decodes = 0
        self.finished: list[str] = []

    async def run(self, fn: Callable[..., Any], *args: Any, priority: int = 0) -> Timed[Any]:
        self.decodes += 1
        text = self.heard(args[0])
        if text == PHRASES[0]:
            await self.release.wait()
        self.finished.append(text)
        return Timed(Transcript(text=text, language="en"), 0.0, 1.0)


def _phrase_of(audio: np.ndarray) -> str:
    """Which turn's audio this is, by its length (pre-roll included): 30, 12 or 20 windows of speech."""
    windows = len(audio) / WINDOW_SAMPLES
    return PHRASES[0] if windows >= 28 else PHRASES[1] if windows < 20 else PHRASES[2]


async def test_finals_are_sent_in_turn_order_when_a_later_turns_decode_finishes_first() -> None:
    vad = FakeScriptedVad(SCRIPT)
    pool = FakeOutOfOrderPool(_phrase_of)
    events: list[asr_pb2.RecognizeEvent] = []
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000, interim_results=True)
    policy = EndpointingPolicy(candidate_silence_ms=96, hangover_ms=256, fixed_hangover=True)
    stream = RecognitionStream(config, policy, vad, FakeTranscriber(), pool, events.append)
    for seq in range(sum(count for _, count in SCRIPT)):  # as fast as the frames come (`transcribe --fast`)
        stream.push_frame(audio_pb2.AudioFrame(data=TONE, seq=seq, sample_rate_hz=16000))
        await asyncio.sleep(0)
    for _ in range(20):
        await asyncio.sleep(0)
    # The premise: the second and third turns' decodes are done while the first one's is not.
    assert stream.turn_index == 3
    assert PHRASES[1] in pool.finished and PHRASES[2] in pool.finished and PHRASES[0] not in pool.finished
    pool.release.set()
    await asyncio.wait_for(stream.drain(), 5)
    finals = [(e.turn_index, e.final.text) for e in events if e.WhichOneof("event") == "final"]
    assert finals == list(enumerate(PHRASES))
    # No transcript of a later turn comes before the final of the turn before it either.
    order = [(e.turn_index, e.WhichOneof("event")) for e in events if e.WhichOneof("event") in TRANSCRIPTS]
    final_at = {turn: order.index((turn, "final")) for turn in range(3)}
    for position, (turn, _) in enumerate(order):
        assert turn == 0 or position > final_at[turn - 1], order


async def test_a_failed_decode_does_not_hold_back_the_finals_after_it() -> None:
    """The call ends on a decode that raised; the turns after it are not left waiting forever (the drain ends)."""

    class FakeBrokenFirstPool(FakeOutOfOrderPool):
        async def run(self, fn: Callable[..., Any], *args: Any, priority: int = 0) -> Timed[Any]:
            if self.heard(args[0]) == PHRASES[0]:
                await self.release.wait()
                raise RuntimeError("decoder crashed")
            return await super().run(fn, *args, priority=priority)

    vad = FakeScriptedVad(SCRIPT)
    pool = FakeBrokenFirstPool(_phrase_of)
    events: list[asr_pb2.RecognizeEvent] = []
    failures: list[BaseException] = []
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000)
    policy = EndpointingPolicy(candidate_silence_ms=96, hangover_ms=256, fixed_hangover=True)
    stream = RecognitionStream(config, policy, vad, FakeTranscriber(), pool, events.append, fail=failures.append)
    for seq in range(sum(count for _, count in SCRIPT)):
        stream.push_frame(audio_pb2.AudioFrame(data=TONE, seq=seq, sample_rate_hz=16000))
        await asyncio.sleep(0)
    pool.release.set()
    await asyncio.wait_for(stream.drain(), 5)
    assert failures
    assert [e.final.text for e in events if e.WhichOneof("event") == "final"] == PHRASES[1:]
