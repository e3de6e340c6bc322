"""The short version of `python -m bench.chaos`: conversations go on while one replica of each stage is killed,
stopped or drained, and no turn or frame is lost. (The figures, timing included, are the benchmark's to report.)"""

from __future__ import annotations

import pytest

from harness.faults import DEFAULT_CLIPS, QUICK_FAULTS, run_fault
from tests.conftest import load_clip
from voicemesh.mesh import Mesh

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("stage", "kind"), QUICK_FAULTS)
async def test_conversations_lose_nothing_when_a_replica_fails(replicas: Mesh, stage: str, kind: str) -> None:
    """The fault strikes the replica holding a session's call at the moment it hurts most (mid-utterance for the
    ASR, mid-generation for the LLM, mid-speech for the TTS), or the test fails saying so: a fault that struck a
    replica with no call on it would pass without testing anything."""
    clips = [load_clip(name) for name in DEFAULT_CLIPS]
    report = await run_fault(replicas, stage, kind, clips, sessions=2, utterances=2)
    assert not report.missed, f"the fault missed: {report.missed}"
    assert report.struck, report
    assert report.turns_attempted == 4
    assert not report.errors, report.errors
    assert report.turns_lost == 0, report.lost
    assert report.reply_frames > 0 and report.reply_frames_lost == 0
    assert report.input_frames_unacknowledged == 0
