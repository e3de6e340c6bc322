"""The servers read what an engine declares: languages (ASR), voices and their rates (TTS), request limits.

The second TTS voice is a test double (`FakeToneSynthesizer`): no second Piper voice is published on PyPI.
The multilingual ASR side is also proven with a real multilingual Whisper model in
tests/integration/test_asr_service.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from services.asr.engine import TranscriberCapabilities
from services.asr.server import validate_config as validate_recognition
from services.tts.engine import SynthesizerCapabilities, Voice
from services.tts.server import (
    MAX_OPEN_UTTERANCES,
    REFILL_MS,
    REMEMBERED_IDS,
    SynthesisStream,
    from_first_sound_of,
)
from services.tts.server import validate_config as validate_synthesis
from tests.unit.recording_pool import RecordingPool
from voicemesh.errors import RequestError
from voicemesh.limits import LOOKAHEAD_WORDS, MAX_TOKENS, OUTPUT_RATES
from voicemesh.v1 import asr_pb2, audio_pb2, tts_pb2
from voicemesh.workers import WorkerPool

PCM16 = audio_pb2.AUDIO_ENCODING_PCM16LE
ENGLISH_ONLY = TranscriberCapabilities(
    frozenset({"en"}), detects_language=False, trimmed_decode=True, word_timings=True
)
MULTILINGUAL = TranscriberCapabilities(
    frozenset({"en", "de", "fr", "ja"}), detects_language=True, trimmed_decode=True, word_timings=True
)


def test_an_english_only_model_refuses_other_languages_and_names_what_it_takes() -> None:
    config = asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=16000, language="de")
    with pytest.raises(RequestError) as refused:
        validate_recognition(config, ENGLISH_ONLY)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message == "language='de' unsupported by this model; send en or leave it empty"
    assert ENGLISH_ONLY.language_for("") == "en"  # empty means the model's only language


def test_a_multilingual_model_accepts_its_languages_and_detects_when_none_is_given() -> None:
    validate_recognition(asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=48000, language="ja"), MULTILINGUAL)
    assert MULTILINGUAL.language_for("") == ""  # detect
    with pytest.raises(ValueError, match="language='xx' unsupported"):
        MULTILINGUAL.language_for("xx")


def test_the_asr_refuses_an_input_rate_it_does_not_resample_from() -> None:
    with pytest.raises(RequestError) as refused:
        validate_recognition(asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=44000), ENGLISH_ONLY)
    assert refused.value.message == (
        "sample_rate_hz=44000 unsupported; send one of 8000, 16000, 22050, 24000, 32000, 44100, 48000"
    )
    for rate in (8000, 44100):  # telephony, and a sound card at 44.1 kHz
        validate_recognition(asr_pb2.RecognitionConfig(session_id="s", sample_rate_hz=rate), ENGLISH_ONLY)


class FakeToneSynthesizer:
    """Two voices at different native rates; each speaks a tone of its own pitch, one piece per word."""

    capabilities = SynthesizerCapabilities(voices=(Voice("low", 16000, "en_US"), Voice("high", 22050, "en_GB")))

    def synthesize(self, text: str, voice: str = "", urgent: bool = False) -> Iterator[np.ndarray]:
        chosen = self.capabilities.voice(voice)
        pitch_hz = 200.0 if chosen.name == "low" else 400.0
        for _word in text.split():
            t = np.arange(chosen.sample_rate_hz // 10) / chosen.sample_rate_hz  # 100 ms
            yield (0.3 * np.sin(2 * np.pi * pitch_hz * t)).astype(np.float32)


def test_a_stream_picks_any_declared_voice_and_an_unknown_one_is_refused_with_the_list() -> None:
    engine = FakeToneSynthesizer()
    config = tts_pb2.SynthesisConfig(session_id="s", sample_rate_hz=16000, encoding=PCM16)
    assert validate_synthesis(config, engine).name == "low"  # the first is the default
    config.voice = "high"
    assert validate_synthesis(config, engine) == Voice("high", 22050, "en_GB")
    config.voice = "en_US-joe-medium"
    with pytest.raises(RequestError) as refused:
        validate_synthesis(config, engine)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message == "voice='en_US-joe-medium' unknown; available: 'low', 'high' (or empty for 'low')"


async def spoken(stream: SynthesisStream, *deltas: str) -> list[tts_pb2.SpeechFrame]:
    """The audio of utterance 1 made of `deltas`, as the stream sends it."""
    for delta in deltas:
        stream.handle(tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=1, text=delta)))
    stream.handle(tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=1)))
    stream.end_input()
    await asyncio.wait_for(stream.synthesize_loop(), 10)
    events = []
    while not stream.events.empty():
        events.append(stream.events.get_nowait())
    return [e.audio for e in events if e is not None and e.WhichOneof("event") == "audio"]


async def test_each_voice_is_resampled_from_its_own_rate_to_the_rate_asked_for() -> None:
    engine = FakeToneSynthesizer()
    durations_ms = {}
    for voice in ("low", "high"):
        config = tts_pb2.SynthesisConfig(
            session_id="s", voice=voice, sample_rate_hz=48000, lookahead_words=1, encoding=PCM16
        )
        stream = SynthesisStream(config, validate_synthesis(config, engine), engine, WorkerPool(1, "test-tts"))
        frames = [speech.frame for speech in await spoken(stream, "one two ")]
        assert frames and all(len(f.data) == 48000 * 2 // 50 for f in frames)  # 20 ms at 48 kHz
        assert {f.sample_rate_hz for f in frames} == {48000}
        durations_ms[voice] = len(frames) * 20
    assert durations_ms["low"] == durations_ms["high"] == 200  # two 100 ms words, whatever the voice's rate


class FakeLeadInSynthesizer(FakeToneSynthesizer):
    """As Piper: each piece starts with 60 ms of near-silence (-80 dBFS noise) before its 100 ms of tone."""

    def synthesize(self, text: str, voice: str = "", urgent: bool = False) -> Iterator[np.ndarray]:
        rate_hz = self.capabilities.voice(voice).sample_rate_hz
        hush = 1e-4 * np.random.default_rng(0).standard_normal(rate_hz * 60 // 1000)
        for tone in super().synthesize(text, voice, urgent):
            yield np.concatenate([hush, tone]).astype(np.float32)


def level_dbfs(frame: tts_pb2.SpeechFrame) -> float:
    samples = np.frombuffer(frame.frame.data, dtype="<i2").astype(np.float64) / 32768
    return float(20 * np.log10(np.sqrt(np.mean(samples**2)) + 1e-12))


def word_stream(engine: FakeToneSynthesizer, trim_lead_in: bool) -> SynthesisStream:
    """A stream that synthesizes word by word (a one-word lookahead) at 16 kHz."""
    config = tts_pb2.SynthesisConfig(session_id="s", sample_rate_hz=16000, lookahead_words=1, encoding=PCM16)
    return SynthesisStream(
        config, validate_synthesis(config, engine), engine, WorkerPool(1, "test-tts"), trim_lead_in=trim_lead_in
    )


@pytest.mark.parametrize("trim", [True, False])
async def test_a_replys_first_chunk_starts_at_its_first_sound_and_later_chunks_keep_their_pause(trim: bool) -> None:
    frames = await spoken(word_stream(FakeLeadInSynthesizer(), trim), "one ", "two ")
    first = [f for f in frames if f.chunk_index == 0]
    second = [f for f in frames if f.chunk_index == 1]
    assert first and second
    if trim:
        # 5 ms of the hush is kept before the tone: the first 20 ms frame is a quarter hush, three quarters tone.
        assert level_dbfs(first[0]) > -20, "the listener hears the reply in its first frame"
        assert len(first) * 20 == 120, "100 ms of tone and 5 ms before it, in 20 ms frames"
    else:
        assert level_dbfs(first[0]) < -60 and len(first) * 20 == 160
    assert level_dbfs(second[0]) < -60 and len(second) * 20 == 160, "a later chunk keeps its pause before it"


class FakeUrgencyRecordingSynthesizer(FakeToneSynthesizer):
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def synthesize(self, text: str, voice: str = "", urgent: bool = False) -> Iterator[np.ndarray]:
        self.calls.append((text.strip(), urgent))
        return super().synthesize(text, voice, urgent)


@pytest.mark.parametrize("trim", [True, False])
async def test_only_a_replys_first_chunk_is_synthesized_as_urgent(trim: bool) -> None:
    engine = FakeUrgencyRecordingSynthesizer()
    await spoken(word_stream(engine, trim), "one ", "two ", "three four five six. ")
    assert engine.calls[0] == ("one", True), "its listener waits for it: every core"
    assert len(engine.calls) > 1 and not any(urgent for _, urgent in engine.calls[1:])


def test_a_chunk_without_any_sound_is_kept_whole() -> None:
    hush = np.full(1600, 1e-4, dtype=np.float32)
    assert from_first_sound_of(hush, 16000) is hush
    onset = np.concatenate([hush, np.full(10, 0.5, dtype=np.float32)])
    assert len(from_first_sound_of(onset, 16000)) == 80 + 10  # 5 ms at 16 kHz before the first sound


def test_limits_are_one_definition_with_one_message() -> None:
    assert MAX_TOKENS.resolve(0, "max_tokens") == 48
    with pytest.raises(RequestError, match=r"max_tokens=513 out of range; send 1-512 \(or 0 for 48\)$"):
        MAX_TOKENS.resolve(513, "max_tokens")
    with pytest.raises(RequestError) as refused:
        LOOKAHEAD_WORDS.resolve(5, "options.tts_lookahead_words")
    assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert OUTPUT_RATES.check(0, "sample_rate_hz") == 16000
    with pytest.raises(RequestError, match=r"send one of 8000, 16000, 22050, 24000, 48000 \(or 0 for 16000\)"):
        OUTPUT_RATES.check(11025, "sample_rate_hz")


class FakeBrokenSynthesizer(FakeToneSynthesizer):
    def synthesize(self, text: str, voice: str = "", urgent: bool = False) -> Iterator[np.ndarray]:
        raise RuntimeError("voice model exploded")


async def test_a_synthesis_that_raises_ends_the_stream_with_the_error_instead_of_going_mute() -> None:
    engine = FakeBrokenSynthesizer()
    config = tts_pb2.SynthesisConfig(session_id="s", sample_rate_hz=16000, lookahead_words=1, encoding=PCM16)
    stream = SynthesisStream(config, validate_synthesis(config, engine), engine, WorkerPool(1, "test-tts"))
    loop = asyncio.ensure_future(stream.synthesize_loop())
    loop.add_done_callback(stream.on_loop_done)
    stream.handle(tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=1, text="one two ")))
    error = await asyncio.wait_for(stream.events.get(), 10)
    assert isinstance(error, RuntimeError) and "voice model exploded" in str(error)


def test_a_tts_stream_bounds_its_open_utterances_and_the_ids_it_remembers() -> None:
    engine = FakeToneSynthesizer()
    config = tts_pb2.SynthesisConfig(session_id="s", sample_rate_hz=16000, lookahead_words=1, encoding=PCM16)
    stream = SynthesisStream(config, validate_synthesis(config, engine), engine, WorkerPool(1, "test-tts"))
    for uid in range(MAX_OPEN_UTTERANCES):
        stream.handle(tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=uid, text="never flushed")))
    with pytest.raises(RequestError) as refused:
        stream.handle(tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=99, text="one more")))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "flush or cancel one" in refused.value.message
    for uid in range(REMEMBERED_IDS + 100):  # a long conversation: cancelled ids stay bounded
        stream.handle(tts_pb2.SynthesizeRequest(cancel=tts_pb2.Cancel(utterance_id=1000 + uid)))
    assert len(stream._cancelled) == len(stream._closed_ids) == REMEMBERED_IDS
    assert 1000 + REMEMBERED_IDS + 99 in stream._cancelled and 1000 not in stream._cancelled


async def test_a_first_chunk_is_due_when_its_text_is_ready_and_a_later_one_before_the_audio_so_far_runs_out() -> None:
    engine = FakeToneSynthesizer()  # 100 ms of audio a word
    config = tts_pb2.SynthesisConfig(session_id="s", sample_rate_hz=16000, lookahead_words=1, encoding=PCM16)
    pool = RecordingPool()  # its priorities are deadlines, ms on time.monotonic: earliest first
    stream = SynthesisStream(config, validate_synthesis(config, engine), engine, pool)
    words = " ".join(f"w{index}" for index in range(14))
    before_ms = time.monotonic_ns() / 1e6
    stream.handle(tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=1, text=words + ". ")))
    stream.handle(tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=1)))
    stream.end_input()
    await asyncio.wait_for(stream.synthesize_loop(), 10)
    first, second, third, fourth = pool.priorities  # "w0", "w1 w2", "w3 .. w6", "w7 .. w13."
    assert before_ms - 1 <= first <= time.monotonic_ns() / 1e6, "a first chunk is due at once: its listener waits"
    assert first - 1 <= second + REFILL_MS - 100 <= time.monotonic_ns() / 1e6, "due when w0's 100 ms run out"
    assert (third - second, fourth - third) == (200, 400), "each chunk bought its own audio's worth of time"


async def test_a_callers_playout_sets_the_next_chunks_deadline_and_a_paused_listener_is_not_hurried() -> None:
    engine = FakeToneSynthesizer()  # 100 ms of audio a word
    config = tts_pb2.SynthesisConfig(session_id="s", sample_rate_hz=16000, lookahead_words=1, encoding=PCM16)

    async def deadlines(playout_ahead_ms: int | None, client_playout: bool = True) -> tuple[float, list[int]]:
        pool = RecordingPool()
        stream = SynthesisStream(
            config, validate_synthesis(config, engine), engine, pool, client_playout=client_playout
        )
        delta = tts_pb2.TextDelta(utterance_id=1, text="w0 w1 w2 ")
        if playout_ahead_ms is not None:
            delta.playout_ahead_ms = playout_ahead_ms
        sent_ms = time.monotonic_ns() / 1e6
        stream.handle(tts_pb2.SynthesizeRequest(text=delta))
        stream.handle(tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=1)))
        stream.end_input()
        await asyncio.wait_for(stream.synthesize_loop(), 10)
        return sent_ms, pool.priorities  # "w0", "w1 w2"

    # The listener has 5 s left (a reply that paused for a false interruption keeps its audio): nothing is urgent.
    sent_ms, (first, second) = await deadlines(5000)
    assert first == pytest.approx(sent_ms + 5000 - REFILL_MS, abs=2), "the caller's playout, not 'at once'"
    assert second - first == 100, "each chunk made since buys its own audio's worth"
    # The listener has run dry: the first chunk is due now, as without a playout, and the rest follow its audio.
    sent_ms, (first, second) = await deadlines(0)
    assert first == pytest.approx(sent_ms - REFILL_MS, abs=2) and second - first == 100
    # Switched off, the field is read (and checked) but deadlines come from the audio made so far.
    sent_ms, (first, _) = await deadlines(5000, client_playout=False)
    assert sent_ms - 1 <= first <= sent_ms + 50


def test_a_playout_ahead_past_ten_minutes_is_refused_with_a_reason() -> None:
    engine = FakeToneSynthesizer()
    config = tts_pb2.SynthesisConfig(session_id="s", sample_rate_hz=16000, lookahead_words=1, encoding=PCM16)
    stream = SynthesisStream(config, validate_synthesis(config, engine), engine, WorkerPool(1, "test-tts"))
    delta = tts_pb2.TextDelta(utterance_id=7, text="hello ", playout_ahead_ms=600_001)
    with pytest.raises(RequestError) as refused:
        stream.handle(tts_pb2.SynthesizeRequest(text=delta))
    assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert "playout_ahead_ms=600001 on utterance 7" in refused.value.message


async def test_without_deadlines_chunks_are_synthesized_in_the_order_they_are_ready() -> None:
    engine = FakeToneSynthesizer()
    config = tts_pb2.SynthesisConfig(session_id="s", sample_rate_hz=16000, lookahead_words=1, encoding=PCM16)
    pool = RecordingPool()
    stream = SynthesisStream(config, validate_synthesis(config, engine), engine, pool, by_deadline=False)
    words = " ".join(f"w{index}" for index in range(14))
    stream.handle(tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=1, text=words + ". ")))
    stream.handle(tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=1)))
    stream.end_input()
    before_ms = time.monotonic_ns() / 1e6
    await asyncio.wait_for(stream.synthesize_loop(), 10)
    assert len(pool.priorities) == 4
    assert pool.priorities == sorted(pool.priorities), "each chunk's priority is when it was handed to the pool"
    assert all(before_ms - 1 <= priority <= time.monotonic_ns() / 1e6 for priority in pool.priorities)


def test_piper_speaks_urgent_text_on_a_session_with_threads_of_its_own() -> None:
    from services.tts.piper_engine import PiperEngine

    engine = PiperEngine(intra_op_threads=1, urgent_threads=2)
    assert (engine.threads(), engine.threads(urgent=True)) == (1, 2)
    for urgent in (False, True):
        audio = np.concatenate(list(engine.synthesize("That is", urgent=urgent)))
        assert len(audio) > 0.2 * engine.capabilities.voices[0].sample_rate_hz and np.abs(audio).max() > 0.05
    assert PiperEngine(intra_op_threads=1).threads(urgent=True) == 1, "0: one session for all text"
    with pytest.raises(ValueError, match="first_chunk_threads=-1 out of range"):
        PiperEngine(intra_op_threads=1, urgent_threads=-1)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"first_chunk_threads": -1}, "tts: first_chunk_threads=-1 out of range; use 0 (as intra_op_threads) or more"),
        ({"intra_op_threads": 0}, "tts: intra_op_threads=0 out of range; use 1 or more"),
    ],
)
def test_a_bad_thread_setting_stops_the_tts_at_start_with_a_reason(fields: dict[str, int], words: str) -> None:
    from services.tts.server import TtsSettings, build_server

    with pytest.raises(SystemExit, match=re.escape(words)):
        build_server(dataclasses.replace(TtsSettings(), **fields))
