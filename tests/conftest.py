"""Shared fixtures: the real-speech clips and a mesh of real services on free loopback ports."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator

import pytest

from harness.clips import ROOT, SHARED_AUDIO, TRANSCRIPTS, clip_path, load_clip, max_wer, synthesized_clip
from voicemesh.mesh import Mesh, free_port

# The clips live in harness/ (the benchmarks speak them too); tests import them from here or from there.
__all__ = ["ROOT", "SHARED_AUDIO", "TRANSCRIPTS", "clip_path", "load_clip", "max_wer", "synthesized_clip"]


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
    from harness.faults import two_replicas  # the gateway's imports, only for the tests that need them

    mesh = two_replicas()
    try:
        asyncio.run(mesh.wait(timeout_s=300))
        yield mesh
    finally:
        mesh.stop_all()
