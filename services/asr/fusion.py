"""The end-of-turn signals fused at a pause: the LLM's P(turn end) of the words, Smart Turn's P of the audio and the
ASR's confidence in its draft, in one logistic fit, mapped onto the hangover by the operating point chosen with it.

The fits are made by `python -m bench.turn_fusion --write` on spoken pauses of held-out dialogue and stored in
turn_fusion.json beside this file (its sources in turn_fusion.md); the ASR's `turn_fusion` setting picks the one
fitted on the text scorer the mesh's LLM runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.asr.engine import Transcript
from voicemesh.endpointing import COMPLETE_AT, INCOMPLETE_AT

FUSION_PATH = Path(__file__).with_name("turn_fusion.json")
FEATURES = ("line_end", "probe", "audio", "avg_logprob", "no_speech_prob", "whisper_end")
"""What a fusion may weigh: the LLM's P(turn end) by either scorer (common scale), Smart Turn's P, and the draft
decode's mean token log-probability, no-speech probability and P(the utterance ends after its last word)."""
TEXT_SCORERS = ("probe", "line_end")
"""The LLM's turn-end scorers a fusion can be fitted on (its `turn_end_scorer` setting)."""
PROBABILITIES = frozenset({"line_end", "probe", "audio", "whisper_end"})
"""Features that are probabilities: they enter as log-odds."""
L2 = 1e-2


def _feature(name: str, value: float) -> float:
    if name in PROBABILITIES:
        p = min(1.0 - 1e-3, max(1e-3, value))
        return math.log(p / (1.0 - p))
    if name == "avg_logprob":
        return max(-3.0, min(0.0, value))
    return value


def features_of(transcript: Transcript, text_scorer: str, text_p: float, audio_p: float | None) -> dict[str, float]:
    """A pause's signals by feature name, as the ASR has them when the LLM's score arrives."""
    values = {text_scorer: text_p, "avg_logprob": transcript.avg_logprob, "no_speech_prob": transcript.no_speech_prob}
    if audio_p is not None:
        values["audio"] = audio_p
    if transcript.end_probability is not None:
        values["whisper_end"] = transcript.end_probability
    return values


@dataclass(frozen=True)
class TurnEndFusion:
    """One logistic fit over `features` and its operating point: a fused log-odds at `complete_at` or above takes
    the short wait, at `incomplete_at` or below the long one, linearly between (as `EndpointingPolicy.hangover_for`
    does on its completeness scale)."""

    name: str
    features: tuple[str, ...]
    weights: tuple[float, ...]
    bias: float
    complete_at: float = 0.0
    incomplete_at: float = -1.0

    def __post_init__(self) -> None:
        unknown = set(self.features) - set(FEATURES)
        if unknown or len(self.weights) != len(self.features):
            raise ValueError(f"fusion {self.name!r}: features {self.features} do not match its weights or {FEATURES}")
        if not self.incomplete_at < self.complete_at:
            raise ValueError(f"fusion {self.name!r}: incomplete_at must be below complete_at")

    @property
    def text_scorer(self) -> str:
        return next((f for f in self.features if f in TEXT_SCORERS), "")

    @property
    def uses_audio(self) -> bool:
        return "audio" in self.features

    def logit(self, values: Mapping[str, float]) -> float:
        """The fused log-odds that the speaker has finished; KeyError names a missing signal."""
        return self.bias + sum(w * _feature(f, values[f]) for f, w in zip(self.features, self.weights, strict=True))

    def logits(self, points: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Each point's fused log-odds; NaN where one of its signals is missing (None), as the ASR then takes the
        LLM's score alone."""
        return np.array(
            [
                self.logit({f: float(p[f]) for f in self.features})
                if all(p.get(f) is not None for f in self.features)
                else np.nan
                for p in points
            ]
        )

    def completeness(self, logit: float) -> float:
        """The fused log-odds on the completeness scale of `hangover_for`: the operating point onto COMPLETE_AT and
        INCOMPLETE_AT, linearly between and beyond."""
        position = (logit - self.incomplete_at) / (self.complete_at - self.incomplete_at)
        return min(1.0, max(0.0, INCOMPLETE_AT + position * (COMPLETE_AT - INCOMPLETE_AT)))

    def weights_by_name(self) -> dict[str, float]:
        return {
            "bias": round(self.bias, 4),
            **{f: round(w, 4) for f, w in zip(self.features, self.weights, strict=True)},
        }

    @classmethod
    def fit(cls, name: str, features: Sequence[str], points: Sequence[Mapping[str, Any]]) -> TurnEndFusion:
        """Logistic regression (Newton's method, a light L2 on the weights) of `finished` on `features`, over the
        points that have them all."""
        points = [p for p in points if all(p.get(f) is not None for f in features)]
        x = np.array([[_feature(f, float(p[f])) for f in features] for p in points])
        y = np.array([1.0 if p["finished"] else 0.0 for p in points])
        x = np.hstack([x, np.ones((len(x), 1))])
        w = np.zeros(x.shape[1])
        ridge = np.diag([L2] * len(features) + [0.0])
        for _ in range(50):
            p = 1 / (1 + np.exp(-x @ w))
            gradient = x.T @ (p - y) + ridge @ w
            hessian = x.T @ (x * (p * (1 - p))[:, None]) + ridge
            step = np.linalg.solve(hessian, gradient)
            w -= step
            if np.abs(step).max() < 1e-8:
                break
        return cls(name, tuple(features), tuple(float(v) for v in w[:-1]), float(w[-1]))


@dataclass(frozen=True)
class TurnEndFusions:
    """The fusions shipped with the ASR, one per text scorer with and without the audio model."""

    fusions: tuple[TurnEndFusion, ...]

    def save(self, path: Path) -> None:
        rows = [
            {
                "name": f.name,
                "features": list(f.features),
                "weights": [round(w, 6) for w in f.weights],
                "bias": round(f.bias, 6),
                "complete_at": round(f.complete_at, 6),
                "incomplete_at": round(f.incomplete_at, 6),
            }
            for f in self.fusions
        ]
        path.write_text(json.dumps({"fusions": rows}, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path = FUSION_PATH) -> TurnEndFusions:
        raw = json.loads(path.read_text())
        return cls(
            tuple(
                TurnEndFusion(
                    row["name"],
                    tuple(row["features"]),
                    tuple(row["weights"]),
                    row["bias"],
                    row["complete_at"],
                    row["incomplete_at"],
                )
                for row in raw["fusions"]
            )
        )

    def pick(self, text_scorer: str, audio: bool) -> TurnEndFusion:
        """The fusion over `text_scorer`'s P, the ASR's confidence and (with `audio`) Smart Turn's; ValueError naming
        what is there when none is."""
        for fusion in self.fusions:
            if fusion.text_scorer == text_scorer and fusion.uses_audio == audio:
                return fusion
        there = ", ".join(f.name for f in self.fusions)
        raise ValueError(
            f"no fusion over the {text_scorer!r} text score {'with' if audio else 'without'} audio ({there})"
        )
