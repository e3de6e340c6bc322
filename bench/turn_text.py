"""End of turn on text alone, the turn-end scorers side by side: `python -m bench.turn_text [--sgd DIR --taskmaster4 DIR]`.

Two sets, each scored by `line_end` (the model's P of a line end) and `probe` (the learned probe), each at its own
operating point:
- `sentences`: the sentences of bench/turn_sentences.py word by word, through the LLM service's own engine (built
  from the VOICEMESH_LLM_* settings), with the full stop Whisper writes at a pause;
- `dialogues` (with the corpora): held-out real dialogue (SGD's test split and Taskmaster-4, which no probe was
  fitted or chosen on), every word end of the first user lines of each dialogue, read the way the training script
  reads them (services/llm/train_turn_probe.py).

For each: the share of finished turns that take the short wait, how long they wait, and the share of points inside
a turn that would commit within a 200, 400 or 600 ms pause (each such pause there a cut-off). `calibrations` gives,
for the configured scorer, the same for other operating points: what to choose another model's
turn_end_complete_at and turn_end_incomplete_at from.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
from pathlib import Path

import numpy as np

from bench import print_result
from services.llm.engine import GenerationRequest, Message
from services.llm.server import LlmSettings, build_engine
from services.llm.turn_end import SCORERS, operating_point
from voicemesh import config
from voicemesh.endpointing import EndpointingPolicy, TurnEndCalibration

CANDIDATE_COMPLETE_AT = (0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
"""The `calibrations` table's short-wait points; each one's long-wait point is half of it."""
DIALOGUES = 250
"""Held-out dialogues of each corpus (the training script reports on the same ones)."""


async def sentence_scores(scorer: str) -> tuple[dict[str, tuple[list[float], list[float]]], TurnEndCalibration]:
    """P(turn end) word by word through each split of bench/turn_sentences.py, by the service's engine running
    `scorer`: (finished, inside) per split, and the calibration the engine applies."""
    from bench.turn_sentences import CHECK, READ, TUNE

    settings = dataclasses.replace(config.build(LlmSettings, "llm"), turn_end_scorer=scorer)
    engine = build_engine(settings)
    await engine.start()
    scores: dict[str, tuple[list[float], list[float]]] = {}
    try:
        for split, sentences in (("tune", TUNE), ("check", CHECK), ("read", READ)):
            finished: list[float] = []
            inside: list[float] = []
            for index, sentence in enumerate(sentences):
                words = sentence.split()
                for count in range(1, len(words) + 1):
                    text = " ".join(words[:count])
                    if count < len(words):
                        text = text.rstrip(",") + "."
                    request = GenerationRequest(
                        f"{split}-{index}", [Message("user", text)], max_tokens=1, score_turn_end=True
                    )
                    got = [c.turn_end async for c in engine.generate(request) if c.turn_end is not None]
                    (finished if count == len(words) else inside).append(got[0])
            scores[split] = (finished, inside)
        calibration = engine.turn_end_calibration
    finally:
        await engine.close()
    return scores, calibration


def dialogue_scores(sgd: Path | None, taskmaster4: Path | None, count: int) -> dict[str, dict[str, object]]:
    """Both scorers on the same logits of every point of the held-out dialogues."""
    from services.llm.llama_common import token_of, token_pieces
    from services.llm.train_turn_probe import Reader, held_out_dialogues, read_points, served_model_path
    from services.llm.turn_end import build_scorer

    reader = Reader(served_model_path())
    lookup = functools.partial(token_of, reader.model, token_pieces(reader.model))
    policy = EndpointingPolicy()
    report: dict[str, dict[str, object]] = {}
    scorers = {name: build_scorer(name, "", reader.model_id, reader.end_ids, lookup, None) for name in SCORERS}
    for corpus, dialogues in held_out_dialogues(sgd, taskmaster4, count).items():
        points = read_points(
            dialogues, reader, lambda row: np.array([s.probability(row) for s in scorers.values()]), seed=len(corpus)
        )
        labels = points["label"]
        report[corpus] = {"dialogues": len(dialogues), "finished": int(labels.sum()), "inside": int((~labels).sum())}
        for column, (name, scorer) in enumerate(scorers.items()):
            p = points["features"][:, column]
            report[corpus][name] = operating_point(p[labels], p[~labels], scorer.calibration, policy)
    return report


async def run(sgd: Path | None, taskmaster4: Path | None, dialogues: int) -> dict[str, object]:
    policy = EndpointingPolicy()
    configured = config.build(LlmSettings, "llm").turn_end_scorer
    report: dict[str, object] = {"configured_scorer": configured}
    sentences: dict[str, dict[str, object]] = {}
    for scorer in SCORERS:
        scores, calibration = await sentence_scores(scorer)
        every_finished = [p for finished, _ in scores.values() for p in finished]
        every_inside = [p for _, inside in scores.values() for p in inside]
        sentences[scorer] = {
            split: operating_point(finished, inside, calibration, policy)
            for split, (finished, inside) in scores.items()
        }
        sentences[scorer]["all"] = operating_point(every_finished, every_inside, calibration, policy)
        if scorer == configured:
            report["calibrations"] = [
                operating_point(every_finished, every_inside, TurnEndCalibration(c, c / 2), policy)
                for c in CANDIDATE_COMPLETE_AT
            ]
    report["sentences"] = sentences
    if sgd is not None or taskmaster4 is not None:
        report["dialogues"] = dialogue_scores(sgd, taskmaster4, dialogues)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sgd", type=Path, help="the Schema-Guided Dialogue checkout (its test/ split is read)")
    parser.add_argument("--taskmaster4", type=Path, help="Taskmaster's TM-4-2024/data")
    parser.add_argument("--dialogues", type=int, default=DIALOGUES, help="held-out dialogues of each corpus")
    args = parser.parse_args(argv)
    print_result(asyncio.run(run(args.sgd, args.taskmaster4, args.dialogues)))


if __name__ == "__main__":
    main()
