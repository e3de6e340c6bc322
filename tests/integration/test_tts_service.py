"""The TTS service on the real Piper joe-medium voice, over real gRPC."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tests.integration.helpers import expect_error, requests
from voicemesh import clients
from voicemesh.audio import Clip, pcm16_to_float
from voicemesh.evaluation import word_error_rate
from voicemesh.v1 import asr_pb2, audio_pb2, tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.integration
TEXT = "Sure, the weather in Paris is sunny today, with a light breeze from the west."


async def collect(target: str, text: str, chunking: int, interval_s: float = 0.0, rate_hz: int = 16000):
    deltas = [w + " " for w in text.split(" ")]
    return [e async for e in clients.synthesize(target, deltas, rate_hz, chunking, 2, interval_s)]


async def test_words_k2_speaks_before_the_sentence_is_complete(services: dict[str, str]) -> None:
    # Deltas 50 ms apart, like an LLM stream: the whole sentence takes ~0.75 s to arrive.
    events = await collect(services["tts"], TEXT, tts_pb2.CHUNKING_POLICY_WORDS, interval_s=0.05)
    frames = [(t, e.audio) for t, e in events if e.WhichOneof("event") == "audio"]
    last_delta_sent_s = 0.05 * (len(TEXT.split(" ")) - 1)
    assert frames[0][0] < last_delta_sent_s
    assert frames[0][1].text == "Sure,"  # punctuation ends the first chunk early
    assert frames[0][1].timing.compute_ms > 0


async def test_frames_cover_the_text_and_the_audio_says_it(services: dict[str, str]) -> None:
    events = await collect(services["tts"], TEXT, tts_pb2.CHUNKING_POLICY_WORDS)
    frames = [e.audio for _, e in events if e.WhichOneof("event") == "audio"]
    done = [e.done for _, e in events if e.WhichOneof("event") == "done"]
    assert len(done) == 1 and done[0].audio_ms == 20 * len(frames)
    assert all(len(f.frame.data) == 640 for f in frames)  # 20 ms at 16 kHz
    assert [f.frame.seq for f in frames] == list(range(len(frames)))
    chunk_texts = [f.text for f in frames if f.chunk_end]
    assert " ".join(chunk_texts) == TEXT
    # Led by 300 ms of silence, as a microphone's stream is: the first word is then heard whole, not clipped by
    # the ASR's voice detection starting on it ("Sure," was once heard as "Architecture").
    speech = pcm16_to_float(b"".join(f.frame.data for f in frames))
    audio = Clip(np.concatenate([np.zeros(4800, np.float32), speech]), 16000)
    # One utterance, decoded whole: the pause the voice makes at "Sure," is not a turn end here. (Split there, the
    # lone first word was once heard as "Cheer. Cheer." under a loaded machine.)
    whole = asr_pb2.RecognitionConfig(
        endpointing=asr_pb2.EndpointingConfig(fixed_hangover=True, hangover_ms=2000), skip_word_timings=True
    )
    heard = " ".join(
        [
            e.final.text
            async for _, e in clients.recognize(services["asr"], audio, realtime=False, config=whole)
            if e.WhichOneof("event") == "final"
        ]
    )
    assert word_error_rate(TEXT, heard) <= 0.3, heard


@pytest.mark.parametrize("rate_hz", [8000, 16000, 24000, 48000])
async def test_output_rates(services: dict[str, str], rate_hz: int) -> None:
    events = await collect(services["tts"], "Hello there.", tts_pb2.CHUNKING_POLICY_SENTENCE, rate_hz=rate_hz)
    frames = [e.audio.frame for _, e in events if e.WhichOneof("event") == "audio"]
    assert all(f.sample_rate_hz == rate_hz and len(f.data) == rate_hz // 50 * 2 for f in frames)
    assert 0.4 < len(frames) * 0.02 < 2.0


async def test_cancel_stops_the_utterance(services: dict[str, str]) -> None:
    config = tts_pb2.SynthesisConfig(
        session_id="cancel", sample_rate_hz=16000, encoding=audio_pb2.AUDIO_ENCODING_PCM16LE
    )
    long_text = "This is a long reply that keeps going. " * 6

    async def requests_then_cancel():
        yield tts_pb2.SynthesizeRequest(config=config)
        yield tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=1, text=long_text))
        yield tts_pb2.SynthesizeRequest(cancel=tts_pb2.Cancel(utterance_id=1))
        yield tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=2, text="Okay."))
        yield tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=2))

    async with grpc.aio.insecure_channel(services["tts"]) as channel:
        events = [e async for e in tts_pb2_grpc.SynthesizerStub(channel).StreamingSynthesize(requests_then_cancel())]
    kinds = [(e.WhichOneof("event"), getattr(e, e.WhichOneof("event")).utterance_id) for e in events]
    cancelled_at = kinds.index(("cancelled", 1))
    assert ("audio", 1) not in kinds[cancelled_at:]
    assert ("audio", 2) in kinds and kinds[-1] == ("done", 2)
    assert sum(1 for k in kinds if k == ("audio", 1)) < 50  # nowhere near the ~10 s the long text would take


def _config(**fields: object) -> tts_pb2.SynthesizeRequest:
    base: dict[str, object] = {
        "session_id": "bad",
        "sample_rate_hz": 16000,
        "encoding": audio_pb2.AUDIO_ENCODING_PCM16LE,
    }
    base.update(fields)
    return tts_pb2.SynthesizeRequest(config=tts_pb2.SynthesisConfig(**base))


def _text(text: str, uid: int = 1) -> tts_pb2.SynthesizeRequest:
    return tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=uid, text=text))


@pytest.mark.parametrize(
    ("messages", "code", "words"),
    [
        (
            [_config(voice="en_GB-nobody")],
            grpc.StatusCode.INVALID_ARGUMENT,
            ("voice='en_GB-nobody' unknown", "en_US-joe-medium"),
        ),
        ([_config(sample_rate_hz=11025)], grpc.StatusCode.INVALID_ARGUMENT, ("sample_rate_hz=11025",)),
        ([_config(encoding=audio_pb2.AUDIO_ENCODING_OPUS)], grpc.StatusCode.INVALID_ARGUMENT, ("AUDIO_ENCODING_OPUS",)),
        # Found by bench/chaos/fuzz.py: an encoding the proto does not define was INTERNAL (its name was looked up).
        ([_config(encoding=-16889544)], grpc.StatusCode.INVALID_ARGUMENT, ("encoding=-16889544 unsupported",)),
        ([_config(lookahead_words=9)], grpc.StatusCode.OUT_OF_RANGE, ("lookahead_words=9",)),
        ([_config(), _text("")], grpc.StatusCode.INVALID_ARGUMENT, ("empty",)),
        ([_config(), _text("a" * 5000)], grpc.StatusCode.OUT_OF_RANGE, ("5000 bytes", "4096")),
        ([_text("hi")], grpc.StatusCode.FAILED_PRECONDITION, ("first message", "SynthesisConfig")),
        ([_config(), _config()], grpc.StatusCode.FAILED_PRECONDITION, ("second SynthesisConfig",)),
        (
            [_config(), _text("hi"), tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=1)), _text("again")],
            grpc.StatusCode.FAILED_PRECONDITION,
            ("utterance 1 was already flushed",),
        ),
    ],
)
async def test_bad_input_gets_a_clear_status(services: dict[str, str], messages: list, code, words) -> None:
    async with grpc.aio.insecure_channel(services["tts"]) as channel:
        call = tts_pb2_grpc.SynthesizerStub(channel).StreamingSynthesize(requests(*messages))
        await expect_error(call, code, *words)
