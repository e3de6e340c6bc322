"""Shared fixtures: the real-speech clips and a mesh of real services on free loopback ports."""

from __future__ import annotations

import asyncio
import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from voicemesh.audio import Clip, float_to_pcm16, read_wav, resample, write_wav
from voicemesh.mesh import Mesh, free_port

ROOT = Path(__file__).resolve().parents[1]
# Real speech for the tests; VOICEMESH_SPEECH_DIR points elsewhere (an empty dir checks the synthesized fallback).
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
    needs a human's pauses or a second speaker says so and skips instead (`needs_human_speech`)."""
    from services.tts.piper_engine import PiperEngine

    engine = PiperEngine(intra_op_threads=2)
    voice = engine.capabilities.voices[0]
    audio = resample(np.concatenate(list(engine.synthesize(TRANSCRIPTS[name]))), voice.sample_rate_hz, 16000)
    silence = np.zeros(16000 * 3 // 10, dtype=np.float32)
    return Clip(np.concatenate([silence, audio, silence]), 16000)


def max_wer(name: str) -> float:
    """The word error rate a transcript of the clip may have: 0.15 on the real recording; on our own TTS's
    reading, one wrong word (Whisper hears Piper's "The horizon" as "That horizon")."""
    if (SHARED_AUDIO / f"{name}.wav").exists():
        return 0.15
    return max(0.15, 1 / len(TRANSCRIPTS[name].split()))


def needs_human_speech(name: str, why: str) -> None:
    """Skip, saying why, where only the real recording will do (its pauses, its voice)."""
    if not (SHARED_AUDIO / f"{name}.wav").exists():
        pytest.skip(f"{SHARED_AUDIO / name}.wav is absent and synthesized speech will not do: {why}")


@pytest.fixture(scope="session")
def services() -> dict[str, str]:
    """ASR, LLM and TTS as separate processes, as in production; yields name -> target."""
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix="voicemesh-test-logs-"))
    for name in ("asr", "llm", "tts"):
        mesh.start(name, free_port())
    try:
        asyncio.run(mesh.wait(timeout_s=240))
        yield {name: process.target for name, process in mesh.processes.items()}
    finally:
        mesh.stop_all()


@pytest.fixture(scope="session")
def replicas() -> Iterator[Mesh]:
    """Two replicas of each service (asr-a, asr-b, llm-a, ...), for tests that kill or stop one of them."""
    from bench.chaos.faults import two_replicas

    mesh = two_replicas()
    try:
        asyncio.run(mesh.wait(timeout_s=300))
        yield mesh
    finally:
        mesh.stop_all()
