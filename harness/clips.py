"""The real-speech clips the tests and the benchmarks speak: ../shared/audio, or, in a clone without it, their
transcripts read by our own TTS."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import numpy as np

from voicemesh.audio import Clip, float_to_pcm16, read_wav, resample, write_wav

ROOT = Path(__file__).resolve().parents[1]
# Real speech; VOICEMESH_SPEECH_DIR points elsewhere (an empty dir checks the synthesized fallback).
SHARED_AUDIO = Path(os.environ.get("VOICEMESH_SPEECH_DIR", ROOT.parent / "shared" / "audio"))

# Reference transcripts from ../shared/audio/SOURCES.md.
TRANSCRIPTS = {
    "jfk": "And so my fellow Americans, ask not what your country can do for you, "
    "ask what you can do for your country.",
    "spk1_snt1": "The child almost hurt the small dog.",
    "spk2_snt1": "We are sure that one war is enough.",
    "wizard": "He began a confused complaint against the wizard, who had vanished behind the curtain on the left.",
    "horizon": "The horizon seems extremely distant.",
}


def load_clip(name: str) -> Clip:
    """The real clip from ../shared/audio, or, in a clone without it, its transcript spoken by our own TTS."""
    path = SHARED_AUDIO / f"{name}.wav"
    return read_wav(path) if path.exists() else synthesized_clip(name)


def clip_path(name: str) -> Path:
    """A wav file of `load_clip(name)`, for what reads files (the load test, the browser's fake microphone)."""
    path = SHARED_AUDIO / f"{name}.wav"
    if path.exists():
        return path
    synthesized = Path(tempfile.gettempdir()) / f"voicemesh-synthesized-{name}.wav"
    if not synthesized.exists():
        write_wav(synthesized, float_to_pcm16(synthesized_clip(name).samples), 16000)
    return synthesized


@functools.cache
def synthesized_clip(name: str) -> Clip:
    """TRANSCRIPTS[name] spoken by Piper (en_US-joe-medium) at 16 kHz with 300 ms of silence around it.

    A clone without ../shared still tests the whole pipeline on speech; one voice, read evenly, so a test that
    needs a human's pauses or a second speaker says so and skips instead (tests/conftest.py `needs_human_speech`)."""
    return spoken(TRANSCRIPTS[name])


@functools.cache
def spoken(text: str, rate_hz: int = 16000) -> Clip:
    """`text` read by Piper (en_US-joe-medium) at `rate_hz`, with 300 ms of silence around it: the same samples
    every time, in every process, for a scenario that must not depend on a take.

    Piper's VITS model samples noise for the voice's timbre (`noise_scale`) and for each phoneme's length
    (`noise_w_scale`), so two readings of one text differ (53,760 and 54,784 samples for the same question). Both
    are 0 here: the model is then a pure function of the text, and the reading is identical, sample for sample."""
    from piper import SynthesisConfig

    from services.tts.piper_engine import _load, default_voice_path

    voice = _load(default_voice_path(), intra_op_threads=2)
    noiseless = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
    chunks = [chunk.audio_float_array for chunk in voice.synthesize(text, noiseless)]
    audio = resample(np.concatenate(chunks), voice.config.sample_rate, rate_hz)
    silence = np.zeros(rate_hz * 3 // 10, dtype=np.float32)
    return Clip(np.concatenate([silence, audio, silence]), rate_hz)


def max_wer(name: str) -> float:
    """The word error rate a transcript of the clip may have: 0.15 on the real recording; on our own TTS's
    reading, one wrong word (Whisper hears Piper's "The horizon" as "That horizon")."""
    if (SHARED_AUDIO / f"{name}.wav").exists():
        return 0.15
    return max(0.15, 1 / len(TRANSCRIPTS[name].split()))
