"""Transcripts across a pause (issue 40): the ASR service on speech whose turn a language model's score commits early.
Before the fix, the last sound of the last word became a turn of its own whose words repeated the committed ones
("turn off the kitchen light", then "lights"): at the gateway, words over a reply none of which was heard, so the
reply was dropped and the user's line became "turn off the kitchen light lights"."""

from __future__ import annotations

import asyncio
import re
import tempfile
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from harness.clips import spoken
from voicemesh.audio import FRAME_MS, Clip
from voicemesh.clients import pcm_frame
from voicemesh.mesh import Mesh, free_port
from voicemesh.v1 import asr_pb2, asr_pb2_grpc

pytestmark = pytest.mark.integration

SENTENCE = "Turn off the kitchen lights."


def words_of(text: str) -> list[str]:
    """Lower case, no punctuation."""
    return re.findall(r"[a-z0-9']+", text.lower())


@pytest.fixture(scope="module")
def asr() -> Iterator[str]:
    """The ASR service alone, as its own process."""
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix="voicemesh-test-logs-"))
    process = mesh.start("asr", free_port())
    try:
        asyncio.run(mesh.wait(timeout_s=240))
        yield process.target
    finally:
        mesh.stop_all()


async def _recognize_scored(target: str, clip: Clip, finished: str) -> list[asr_pb2.RecognizeEvent]:
    """Stream `clip` in real time as the gateway does, and score each pause as its LLM would: sure the turn is over
    (0.9) where the candidate's words end in `finished`, sure it is not (0.1) elsewhere. Frames wait while a pause's
    score is on its way, so the score always comes in the pause's first windows (the LLM's prefill of the same words
    had it ready): the earliest commit the gateway can cause."""
    frames = clip.to_rate(16000).frames() + [b"\x00" * 640] * 50
    requests: asyncio.Queue[asr_pb2.RecognizeRequest | None] = asyncio.Queue()
    go = asyncio.Event()
    go.set()
    config = asr_pb2.RecognitionConfig(
        session_id="pause-transcript",
        sample_rate_hz=16000,
        interim_results=True,
        skip_word_timings=True,
        turn_scores=True,
    )

    async def send() -> None:
        for seq, data in enumerate(frames):
            await go.wait()
            await asyncio.sleep(FRAME_MS / 1000)
            requests.put_nowait(asr_pb2.RecognizeRequest(frame=pcm_frame(data, 16000, seq)))
        requests.put_nowait(None)

    async def stream() -> AsyncIterator[asr_pb2.RecognizeRequest]:
        yield asr_pb2.RecognizeRequest(config=config)
        while (request := await requests.get()) is not None:
            yield request

    events = []
    async with grpc.aio.insecure_channel(target) as channel:
        sender = asyncio.ensure_future(send())
        async for event in asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(stream()):
            kind = event.WhichOneof("event")
            events.append(event)
            if kind == "speech_stopped":
                go.clear()  # until this pause is scored (or the speech goes on)
            elif kind == "speech_resumed":
                go.set()
            elif kind == "endpoint_candidate":
                over = " ".join(words_of(event.endpoint_candidate.text)).endswith(finished)
                score = asr_pb2.TurnScore(pause_id=event.endpoint_candidate.pause_id, probability=0.9 if over else 0.1)
                requests.put_nowait(asr_pb2.RecognizeRequest(turn_score=score))
                go.set()
        await sender
    return events


async def test_the_last_sound_of_a_word_heard_after_an_early_commit_is_not_a_turn(asr: str) -> None:
    """The LLM's score committed "turn off the kitchen light" 64 ms into the pause before the "s"; the "s" opened a
    second turn, decoded (with a pre-roll reaching back into "light") as "lights" or "states": at the gateway, a word
    over the unheard reply, which dropped it (NO_AUDIO) and joined it to the committed line, a word repeated."""
    events = await _recognize_scored(asr, spoken(SENTENCE), finished="light")
    finals = [(e.turn_index, e.final.text) for e in events if e.WhichOneof("event") == "final"]
    assert len(finals) == 1, finals
    assert "kitchen" in words_of(finals[0][1]), finals
    assert [e.WhichOneof("event") for e in events].count("speech_started") == 1
