"""The shipped turn-end probe on the embedded model: it separates finished user lines from lines cut mid-sentence
(sentences written for this test, none from the training corpora), it is what the engine scores with by default,
and a probe for another model stops the LLM service at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from services.llm.engine import GenerationRequest, Message
from services.llm.llama_batch_engine import LlamaBatchEngine
from services.llm.llama_common import default_model_path
from services.llm.turn_end import TurnEndChoice
from services.llm.turn_probe import DEFAULT_PATH, TurnEndProbe
from services.llm.vocabulary import latin1_model

FINISHED = (
    "Can you book me a table for two tonight?",
    "I need a taxi to the airport.",
    "What's the weather like in Boston tomorrow?",
    "Play some jazz in the kitchen.",
    "Thanks, that's all I needed.",
    "How far is the nearest pharmacy?",
    "Yes, please go ahead.",
    "No, I'd rather leave on Friday.",
    "Remind me to water the plants at six.",
    "Is the museum open on Mondays?",
    "I'd like to cancel my reservation.",
    "That sounds perfect.",
    "Could you find me a cheap hotel in Denver?",
    "Turn off the lights in the bedroom.",
    "What time does the last train leave?",
    "I want to buy two tickets for the eight o'clock show.",
    "Send a message to my sister saying I'm running late.",
    "Which one has the better reviews?",
    "Okay, let's do that one.",
    "My flight lands at half past nine.",
)
UNFINISHED = (
    "Can you book me a table for",
    "I need a taxi to the",
    "What's the weather like in",
    "Play some jazz in the",
    "I'd like to cancel my",
    "Could you find me a cheap hotel in",
    "Remind me to water the",
    "I want to buy two tickets for the",
    "Send a message to my sister saying",
    "Is the museum open on",
    "What time does the",
    "My flight lands at half past",
    "No, I'd rather leave on",
    "Turn off the lights in the",
    "How far is the nearest",
    "I was wondering if you could",
    "Let me think, I want the one with",
    "Actually, can you change it to",
    "So the thing is, um,",
    "And then after that I need",
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine():
    engine = LlamaBatchEngine(latin1_model(default_model_path()), max_batch=2, turn_end=TurnEndChoice("probe"))
    await engine.start()
    yield engine
    await engine.close()


async def score(engine: LlamaBatchEngine, index: int, words: str) -> float:
    dialogue = [Message("assistant", "Hi, how can I help?"), Message("user", words)]
    request = GenerationRequest(f"probe-{index}", dialogue, max_tokens=1, score_turn_end=True)
    got = [chunk.turn_end async for chunk in engine.generate(request) if chunk.turn_end is not None]
    assert len(got) == 1, f"no turn-end score for {words!r}"
    return got[0]


@pytest.mark.asyncio(loop_scope="session")
async def test_the_shipped_probe_separates_finished_lines_from_lines_cut_mid_sentence(engine) -> None:
    calibration = engine.turn_end_calibration
    probe = TurnEndProbe.load(DEFAULT_PATH)
    assert (calibration.complete_at, calibration.incomplete_at) == (probe.complete_at, probe.incomplete_at)
    finished = np.array([await score(engine, i, text) for i, text in enumerate(FINISHED)])
    unfinished = np.array([await score(engine, 100 + i, text) for i, text in enumerate(UNFINISHED)])
    # Every pair ordered right but a few: the area under the curve.
    auc = float((finished[:, None] > unfinished[None, :]).mean())
    assert auc >= 0.95, f"AUC {auc:.3f}; finished {np.round(finished, 2)}, unfinished {np.round(unfinished, 2)}"
    short = [t for t, p in zip(FINISHED, finished, strict=True) if p >= calibration.complete_at]
    cut = [t for t, p in zip(UNFINISHED, unfinished, strict=True) if p >= calibration.complete_at]
    assert len(short) >= 0.8 * len(FINISHED), f"finished lines at the short wait: {short}"
    assert len(cut) <= 1, f"lines cut mid-sentence at the short wait: {cut}"


def test_a_probe_for_another_model_stops_the_llm_service_at_start_naming_both(tmp_path: Path) -> None:
    other = tmp_path / "other.npz"
    TurnEndProbe("llama/llama-3/8B/d4096/l32", (",",), np.array([1.0]), 1.0, 0.0, 0.0, 0.6, 0.3).save(other)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.llm.server",
            "--port",
            "0",
            "--turn-end-scorer",
            "probe",
            "--turn-end-probe",
            str(other),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert str(other) in done.stderr and "llama/llama-3/8B" in done.stderr and "gemma3/" in done.stderr, done.stderr
