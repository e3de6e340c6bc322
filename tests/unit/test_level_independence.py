"""Where the ASR hears speech stop must not depend on how loud the speaker is: a distant laptop microphone (20-40 dB
quieter) and a hot headset (6 dB louder) get the same pauses as the recording. Real Silero VAD, real speech."""

from __future__ import annotations

import numpy as np
import pytest

from services.asr.endpointing import Endpointer, Event
from services.asr.stream import Loudness
from services.asr.vad import WINDOW_MS, WINDOW_SAMPLES, StreamingVad, load_session
from tests.conftest import load_clip, needs_human_speech
from voicemesh.endpointing import EndpointingPolicy


def speech_stops(samples: np.ndarray) -> list[int]:
    """The stream's speech-stop points (ms), as RecognitionStream finds them: level tracking, normalization, VAD."""
    loudness, vad = Loudness(), StreamingVad(load_session())
    endpointer = Endpointer(EndpointingPolicy(fixed_hangover=True), WINDOW_MS)
    audio = np.concatenate([samples, np.zeros(16000, np.float32)])
    stops = []
    for start in range(0, len(audio) - WINDOW_SAMPLES + 1, WINDOW_SAMPLES):
        window = audio[start : start + WINDOW_SAMPLES]
        quiet = loudness.quiet(window)
        for event in endpointer.push(vad.probability(loudness.normalize(window)), quiet):
            if event is Event.SPEECH_STOPPED:
                stops.append(endpointer.speech_end_ms)
    return stops


@pytest.mark.parametrize("name", ["spk1_snt1", "wizard", "horizon"])
@pytest.mark.parametrize("gain_db", [6, -20, -30])
def test_speech_stops_at_the_same_points_whatever_the_level(name: str, gain_db: int) -> None:
    needs_human_speech(name, "its pauses and its tail are what is compared")
    samples = load_clip(name).to_rate(16000).samples
    as_recorded = speech_stops(samples)
    other = speech_stops(np.clip(samples * 10 ** (gain_db / 20), -1, 1).astype(np.float32))
    assert other == as_recorded, f"{gain_db:+d} dB: stops at {other} ms, as recorded at {as_recorded} ms"


def test_a_speaker_40_db_down_keeps_their_pauses_within_two_windows() -> None:
    needs_human_speech("spk1_snt1", "its pauses are what is compared")
    samples = load_clip("spk1_snt1").to_rate(16000).samples
    as_recorded, quiet = speech_stops(samples), speech_stops((samples * 0.01).astype(np.float32))
    assert len(quiet) == len(as_recorded), (quiet, as_recorded)
    assert all(abs(a - b) <= 2 * WINDOW_MS for a, b in zip(quiet, as_recorded, strict=True))
