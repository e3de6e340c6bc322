"""When the ASR stream starts its final pass: at the first silence (default) or only at the end of the turn."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from services.asr.completeness import TurnScorer
from services.asr.endpointing import EndpointingPolicy
from services.asr.engine import DecodeOptions, TranscriberCapabilities, Transcript
from services.asr.fusion import TurnEndFusion
from services.asr.stream import (
    DECISION_PARTIAL_PRIORITY,
    FINAL_PRIORITY,
    PARTIAL_PRIORITY,
    RecognitionStream,
)
from services.asr.vad import WINDOW_SAMPLES
from tests.unit.fake_asr import FakeScriptedVad
from tests.unit.recording_pool import RecordingPool
from voicemesh.endpointing import lm_completeness
from voicemesh.v1 import asr_pb2, audio_pb2
from voicemesh.workers import WorkerPool

SPEECH_WINDOWS = 20
PAUSE_WINDOWS = 12


class FakeVad:
    """Speech for the first SPEECH_WINDOWS windows, then silence."""

    def __init__(self) -> None:
        self.windows = 0

    def probability(self, window: np.ndarray) -> float:
        self.windows += 1
        return 0.9 if self.windows <= SPEECH_WINDOWS else 0.0


ENGLISH_ONLY = TranscriberCapabilities(
    languages=frozenset({"en"}), detects_language=False, trimmed_decode=True, word_timings=True
)


# A steady tone: never "quiet", so the (fake) VAD alone decides speech and silence.
TONE = (0.1 * np.sin(np.arange(WINDOW_SAMPLES) * 0.3) * 32767).astype("<i2").tobytes()


async def feed(stream: RecognitionStream, windows: int, pause_s: float = 0.01) -> None:
    """`windows` windows of tone, one at a time, letting decodes run between them as they would in real time; then
    wait for the decodes in flight."""
    for seq in range(windows):
        stream.push_frame(audio_pb2.AudioFrame(data=TONE, seq=seq, sample_rate_hz=16000))
        await asyncio.sleep(pause_s)
    await stream.drain()


class FakeTranscriber:
    """Records at which VAD window each decode was asked for, and with which options."""

    name = "fake"

    def __init__(
        self, vad: FakeVad, capabilities: TranscriberCapabilities = ENGLISH_ONLY, text: str = "hello there."
    ) -> None:
        self.vad = vad
        self.capabilities = capabilities
        self.text = text
        self.calls: list[int] = []
        self.options: list[DecodeOptions] = []

    def transcribe(self, audio: np.ndarray, options: DecodeOptions | None = None) -> Transcript:
        self.calls.append(self.vad.windows)
        self.options.append(options or DecodeOptions())
        return Transcript(text=self.text, language=(options or DecodeOptions()).language or "de")


async def _stream_events(
    transcriber: FakeTranscriber,
    config: asr_pb2.RecognitionConfig,
    partials: tuple[FakeTranscriber, WorkerPool] | None = None,
) -> list[asr_pb2.RecognizeEvent]:
    events: list[asr_pb2.RecognizeEvent] = []
    policy = EndpointingPolicy(candidate_silence_ms=96, hangover_ms=256, fixed_hangover=True)
    vad = transcriber.vad
    pool = WorkerPool(1, "test-asr")
    stream = RecognitionStream(config, policy, vad, transcriber, pool, events.append, partials=partials)
    await feed(stream, SPEECH_WINDOWS + PAUSE_WINDOWS)
    return events


async def _run(final_after_end_of_turn: bool) -> tuple[list[int], list[str]]:
    transcriber = FakeTranscriber(FakeVad())
    config = asr_pb2.RecognitionConfig(
        session_id="s", sample_rate_hz=16000, final_after_end_of_turn=final_after_end_of_turn
    )
    events = await _stream_events(transcriber, config)
    return transcriber.calls, [e.WhichOneof("event") for e in events]


def _final(events: list[asr_pb2.RecognizeEvent]) -> asr_pb2.Final:
    (final,) = [e.final for e in events if e.WhichOneof("event") == "final"]
    return final


async def test_an_english_only_engine_decodes_english_with_the_options_the_stream_asked_for() -> None:
    transcriber = FakeTranscriber(FakeVad())
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000, skip_word_timings=True)
    final = _final(await _stream_events(transcriber, config))
    assert final.language == "en"
    assert transcriber.options[0] == DecodeOptions(language="en", trimmed=True, word_timings=False)


async def test_a_multilingual_engine_detects_the_language_when_the_stream_names_none() -> None:
    multilingual = TranscriberCapabilities(
        languages=frozenset({"en", "de", "fr"}), detects_language=True, trimmed_decode=True, word_timings=True
    )
    transcriber = FakeTranscriber(FakeVad(), multilingual)
    final = _final(await _stream_events(transcriber, asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000)))
    assert transcriber.options[0].language == ""  # the engine is asked to detect it
    assert final.language == "de"  # and the final says what it found
    transcriber = FakeTranscriber(FakeVad(), multilingual)
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000, language="fr")
    assert _final(await _stream_events(transcriber, config)).language == "fr"


async def test_an_engine_without_a_trimmed_decode_or_word_timings_is_not_asked_for_them() -> None:
    plain = TranscriberCapabilities(
        languages=frozenset({"en"}), detects_language=False, trimmed_decode=False, word_timings=False
    )
    transcriber = FakeTranscriber(FakeVad(), plain)
    await _stream_events(transcriber, asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000))
    assert transcriber.options
    assert not any(options.trimmed or options.word_timings for options in transcriber.options)


async def test_partials_go_to_their_own_decoder_and_threads_when_the_service_has_one() -> None:
    vad = FakeVad()
    finals, captions = FakeTranscriber(vad), FakeTranscriber(vad)
    background = WorkerPool(1, "test-asr-partial", nice=5)
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000, interim_results=True)
    kinds = [event.WhichOneof("event") for event in await _stream_events(finals, config, (captions, background))]
    assert "partial" in kinds and kinds.count("final") == 1
    assert captions.calls and all(not options.word_timings for options in captions.options), "partials only"
    assert all(options.word_timings for options in finals.options), "the finals' model decoded no partial"


class FakeJammedPool(WorkerPool):
    """A caption pool whose decodes are queueing (other streams' captions): new captions are shed."""

    @property
    def waiting(self) -> int:
        return 3

    async def run(self, fn, *args, priority: int = 0):  # type: ignore[no-untyped-def]
        raise AssertionError("a caption was decoded although decodes were queueing")


@pytest.mark.parametrize("urgency", [asr_pb2.PARTIAL_URGENCY_CAPTIONS, asr_pb2.PARTIAL_URGENCY_DECISION])
async def test_partials_a_decision_waits_on_are_decoded_beside_finals_and_never_shed(urgency: int) -> None:
    vad = FakeVad()
    finals, captions = FakeTranscriber(vad), FakeTranscriber(vad)
    events: list[asr_pb2.RecognizeEvent] = []
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000, interim_results=True)
    policy = EndpointingPolicy(candidate_silence_ms=96, hangover_ms=256, fixed_hangover=True)
    pool = RecordingPool()
    stream = RecognitionStream(
        config, policy, vad, finals, pool, events.append, partials=(captions, FakeJammedPool(1, "jammed"))
    )
    stream.set_urgency(asr_pb2.Urgency(partials=urgency))  # the user speaks over a reply, or not
    await feed(stream, SPEECH_WINDOWS)
    partials = [event for event in events if event.WhichOneof("event") == "partial"]
    if urgency == asr_pb2.PARTIAL_URGENCY_CAPTIONS:
        assert not partials and not finals.calls, "captions are shed while decodes queue"
    else:
        assert partials and partials[0].partial.text == "hello there.", "the words a decision waits on came"
        assert finals.calls and not captions.calls, "on the finals' model and workers"
        assert set(pool.priorities) == {DECISION_PARTIAL_PRIORITY}
        assert FINAL_PRIORITY < DECISION_PARTIAL_PRIORITY < PARTIAL_PRIORITY, "after finals, before captions"


async def test_final_pass_starts_at_the_first_silent_window_by_default() -> None:
    calls, kinds = await _run(final_after_end_of_turn=False)
    assert calls[0] == SPEECH_WINDOWS + 1  # during the hangover, so the final is ready when the turn commits
    assert kinds.count("final") == 1 and "endpoint_candidate" in kinds


async def test_baseline_final_pass_starts_only_at_the_end_of_the_turn() -> None:
    calls, kinds = await _run(final_after_end_of_turn=True)
    candidate_window = SPEECH_WINDOWS + 3  # 96 ms of silence: the candidate still needs a transcript
    commit_window = SPEECH_WINDOWS + 8  # 256 ms
    assert calls[0] == candidate_window
    assert calls[-1] == commit_window
    assert kinds.count("final") == 1


class SlowTranscriber(FakeTranscriber):
    """A decode that takes longer than a short pause inside the speech."""

    def transcribe(self, audio: np.ndarray, options: DecodeOptions | None = None) -> Transcript:
        time.sleep(0.15)
        return super().transcribe(audio, options)


async def test_speech_after_a_pause_shorter_than_its_draft_is_reported_as_resumed() -> None:
    # 64 ms of silence inside the speech: the draft started there is still decoding when the speech comes back, so no
    # candidate was sent; a listener that was told the speech stopped must still hear that it resumed.
    vad = FakeScriptedVad([(True, 20), (False, 2), (True, 10)])
    events: list[asr_pb2.RecognizeEvent] = []
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000)
    policy = EndpointingPolicy(hangover_ms=256, fixed_hangover=True)
    stream = RecognitionStream(config, policy, vad, SlowTranscriber(vad), WorkerPool(1, "test-asr"), events.append)
    await feed(stream, 32 + 12, 0.005)
    kinds = [e.WhichOneof("event") for e in events if e.WhichOneof("event") != "partial"]
    assert kinds[:4] == ["speech_started", "speech_stopped", "speech_resumed", "speech_stopped"]
    assert kinds.count("final") == 1


class FailingScorer(TurnScorer):
    """A completeness scorer whose audio model raises, as a broken or missing model file would."""

    def __init__(self) -> None:
        super().__init__(None)
        self.calls = 0

    async def audio_score(self, audio: np.ndarray) -> float | None:
        self.calls += 1
        raise RuntimeError("model exploded")


class SlowScorer(TurnScorer):
    """A scorer that answers "incomplete" long after the fixed hangover."""

    async def audio_score(self, audio: np.ndarray) -> float | None:
        await asyncio.sleep(1.0)
        return 0.0


async def _scored_run(
    scorer: TurnScorer, lm_probability: float | None = None, text: str = "hello there.", turn_scores: bool = False
) -> list[asr_pb2.RecognizeEvent]:
    """One utterance (transcribed as `text`) and its pause; with `lm_probability`, the client answers the endpoint
    candidate with it as the gateway does with the LLM's score (with `turn_scores`, as it says it will)."""
    vad = FakeVad()
    events: list[asr_pb2.RecognizeEvent] = []
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000, turn_scores=turn_scores)
    policy = EndpointingPolicy(min_hangover_ms=64, hangover_ms=256)

    def emit(event: asr_pb2.RecognizeEvent) -> None:
        events.append(event)
        if lm_probability is not None and event.WhichOneof("event") == "endpoint_candidate":
            pause_id = event.endpoint_candidate.pause_id
            stream.turn_score(asr_pb2.TurnScore(pause_id=pause_id, probability=lm_probability))

    transcriber = FakeTranscriber(vad, text=text)
    stream = RecognitionStream(config, policy, vad, transcriber, WorkerPool(1, "test-asr"), emit, scorer)
    await feed(stream, SPEECH_WINDOWS + PAUSE_WINDOWS)
    scorer.close()
    return events


@pytest.mark.parametrize("scorer", [FailingScorer(), SlowScorer(None)], ids=["failing", "slow"])
async def test_a_scorer_that_fails_or_is_slow_never_holds_the_turn_open(scorer: TurnScorer) -> None:
    events = await _scored_run(scorer)
    finals = [e.final for e in events if e.WhichOneof("event") == "final"]
    assert len(finals) == 1 and finals[0].text == "hello there."
    assert finals[0].completeness == -1 and finals[0].hangover_ms == 256  # the fixed hangover applied


async def test_the_transcripts_full_stop_alone_waits_the_fixed_hangover() -> None:
    events = await _scored_run(TurnScorer(None))  # text only: "hello there." ends a sentence
    final = next(e for e in events if e.WhichOneof("event") == "final")
    assert final.final.completeness == pytest.approx(0.8) and final.final.hangover_ms == 256


async def test_a_language_model_score_of_the_candidate_commits_after_the_short_hangover() -> None:
    events = await _scored_run(TurnScorer(None), lm_probability=0.9)
    candidate = next(e for e in events if e.WhichOneof("event") == "endpoint_candidate")
    assert candidate.endpoint_candidate.pause_id == 1
    final = next(e for e in events if e.WhichOneof("event") == "final")
    assert final.final.completeness == pytest.approx(lm_completeness(0.9)) and final.final.hangover_ms == 64
    assert final.speech_end_ms == SPEECH_WINDOWS * 32
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds.index("speech_stopped") < kinds.index("final")


async def test_a_language_model_that_hears_no_end_holds_the_turn_open() -> None:
    events = await _scored_run(TurnScorer(None), lm_probability=0.001)  # PAUSE_WINDOWS of silence: < 1200 ms
    assert not any(e.WhichOneof("event") == "final" for e in events)


@pytest.mark.parametrize("text", ["The child almost hurt the small dog. Um.", "I would like, uh", "Erm..."])
async def test_a_transcript_ending_in_a_filled_pause_waits_long_whatever_the_language_model_says(text: str) -> None:
    events = await _scored_run(TurnScorer(None), lm_probability=0.9, text=text)
    assert any(e.WhichOneof("event") == "endpoint_candidate" for e in events)
    assert not any(e.WhichOneof("event") == "final" for e in events), "committed in the pause after the filler"


async def test_a_hum_as_the_whole_answer_is_not_a_filled_pause() -> None:
    events = await _scored_run(TurnScorer(None), lm_probability=0.9, text="Mm-hmm.")
    assert _final(events).hangover_ms == 64


class FakeAudioScorer(TurnScorer):
    """A scorer whose audio model answers `probability` after 60 ms (after the language model's score of the
    candidate is in), with a fusion that weighs the two alike."""

    def __init__(self, probability: float) -> None:
        fusion = TurnEndFusion("t", ("line_end", "audio"), (1.0, 1.0), 0.0, complete_at=1.0, incomplete_at=-1.0)
        super().__init__(None, learned=fusion)
        self.audio_model = object()  # type: ignore[assignment]  # scored here, not by a model
        self.probability = probability

    async def audio_score(self, audio: np.ndarray) -> float | None:
        await asyncio.sleep(0.06)
        return self.probability


async def test_a_language_model_score_in_before_the_audio_score_waits_for_it_when_the_fusion_weighs_audio() -> None:
    # The language model alone (P 0.9) would commit after 64 ms; the audio model hears a voice that goes on.
    events = await _scored_run(FakeAudioScorer(0.001), lm_probability=0.9, turn_scores=True)
    assert any(e.WhichOneof("event") == "endpoint_candidate" for e in events)
    assert not any(e.WhichOneof("event") == "final" for e in events), "the language model's score decided alone"


async def test_a_language_model_score_parked_for_the_audio_score_decides_once_that_is_in() -> None:
    events = await _scored_run(FakeAudioScorer(0.999), lm_probability=0.9, turn_scores=True)
    final = _final(events)
    assert final.hangover_ms == 64 and final.completeness == pytest.approx(1.0)


class BrokenTranscriber(FakeTranscriber):
    """An engine whose decode raises, as a corrupt model or an out-of-memory would."""

    def transcribe(self, audio: np.ndarray, options: DecodeOptions | None = None) -> Transcript:
        raise RuntimeError("decoder exploded")


async def test_a_decode_that_raises_ends_the_call_instead_of_losing_the_turn_in_silence() -> None:
    failures: list[BaseException] = []
    events: list[asr_pb2.RecognizeEvent] = []
    transcriber = BrokenTranscriber(FakeVad())
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000)
    policy = EndpointingPolicy(candidate_silence_ms=96, hangover_ms=256, fixed_hangover=True)
    stream = RecognitionStream(
        config, policy, transcriber.vad, transcriber, WorkerPool(1, "test-asr"), events.append, fail=failures.append
    )
    await feed(stream, SPEECH_WINDOWS + PAUSE_WINDOWS)
    assert failures and all("decoder exploded" in str(error) for error in failures)
    assert not any(e.WhichOneof("event") == "final" for e in events)
