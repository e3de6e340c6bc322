"""Shared fixtures: the real-speech clips and a mesh of real services on free loopback ports."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from voicemesh.audio import Clip, read_wav
from voicemesh.mesh import Mesh, free_port

ROOT = Path(__file__).resolve().parents[1]
SHARED_AUDIO = ROOT.parent / "shared" / "audio"

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
    path = SHARED_AUDIO / f"{name}.wav"
    if not path.exists():
        pytest.skip(f"{path} is absent (a clone without ../shared): real-speech clips are needed for this test")
    return read_wav(path)


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
