"""Turn-end scorers: P(the user's turn ends after their last word), read from the next-token log-probabilities that a
reply's prefill computes there anyway. An LLM replica runs one, chosen by its `turn_end_scorer` setting; each owns its
calibration (where its P means finished and unfinished), which the replica applies before it sends the score.

- `line_end` (default): the probability that the next token ends the line (. ? ! or a line break).
- `probe`: the learned probe (services/llm/turn_probe.py), trained on real dialogue.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from services.llm.prompt import ends_line
from services.llm.turn_probe import DEFAULT_PATH, BoundProbe, TurnEndProbe
from voicemesh.endpointing import (
    COMPLETE_AT,
    INCOMPLETE_AT,
    LM_COMPLETE_AT,
    LM_INCOMPLETE_AT,
    EndpointingPolicy,
    TurnEndCalibration,
)

SCORERS = ("line_end", "probe")


@dataclass(frozen=True)
class TurnEndChoice:
    """Which scorer a replica runs (a setting), bound to the model once it is loaded."""

    scorer: str = "line_end"
    probe_path: str = ""
    """The probe file; empty: the one shipped for the default model."""
    calibration: TurnEndCalibration | None = None
    """Overrides the scorer's own operating point (a model the probe was not trained for)."""


class TurnEndScorer(Protocol):
    """Reads P(turn end) from the log-probabilities of the tokens that may follow the user's last word."""

    @property
    def name(self) -> str: ...

    @property
    def calibration(self) -> TurnEndCalibration:
        """Where its P means finished and unfinished."""
        ...

    @property
    def token_ids(self) -> np.ndarray:
        """The tokens whose log-probabilities it reads (an engine that returns only some asks for these)."""
        ...

    def probability(self, logits: np.ndarray) -> float:
        """From a whole row of logits."""
        ...

    def probability_of(self, logprobs: Mapping[int, float], top_logprob: float) -> float:
        """From the log-probabilities of `token_ids` alone, and the likeliest token's."""
        ...


@dataclass(frozen=True)
class LineEndScorer:
    """P(the next token ends the user's line): the model's own sense of a finished sentence."""

    end_ids: np.ndarray
    calibration: TurnEndCalibration
    name: str = "line_end"

    @property
    def token_ids(self) -> np.ndarray:
        return self.end_ids

    def probability(self, logits: np.ndarray) -> float:
        scores = logits.astype(np.float64)
        probabilities = np.exp(scores - scores.max())
        return float(probabilities[self.end_ids].sum() / probabilities.sum())

    def probability_of(self, logprobs: Mapping[int, float], top_logprob: float) -> float:
        return min(1.0, sum(math.exp(logprobs[token]) for token in self.end_ids.tolist() if token in logprobs))


@dataclass(frozen=True)
class ProbeScorer:
    """The learned probe; its calibration is the operating point chosen with it on held-out dialogue."""

    probe: BoundProbe
    end_ids: np.ndarray
    calibration: TurnEndCalibration
    name: str = "probe"

    @property
    def token_ids(self) -> np.ndarray:
        return np.concatenate([self.probe.token_ids, self.end_ids])

    def probability(self, logits: np.ndarray) -> float:
        return self.probe.probability(logits, self.end_ids)

    def probability_of(self, logprobs: Mapping[int, float], top_logprob: float) -> float:
        ends = [logprobs[token] for token in self.end_ids.tolist() if token in logprobs]
        peak = max(ends, default=-1e9)
        end_logprob = peak + math.log(sum(math.exp(v - peak) for v in ends)) if ends else -1e9
        scores = np.array([logprobs.get(token, -1e9) for token in self.probe.token_ids.tolist()])
        return self.probe.from_scores(scores, end_logprob, top_logprob)


def end_token_ids(pieces: Mapping[int, str]) -> np.ndarray:
    """The ids of the tokens that end a user's line (`ends_line`), from a model's id -> piece table."""
    return np.array(sorted(token for token, piece in pieces.items() if ends_line(piece)), dtype=np.int64)


def build_scorer(
    name: str,
    probe_path: str,
    model_id: str,
    end_ids: np.ndarray,
    token_of: Callable[[str], int | None],
    calibration: TurnEndCalibration | None,
) -> TurnEndScorer:
    """The scorer a replica's settings name, bound to its loaded model. `calibration` overrides the scorer's own.
    Raises ValueError (a probe that is missing or was trained on another model: the message names both)."""
    if name == "line_end":
        return LineEndScorer(end_ids, calibration or TurnEndCalibration())
    if name != "probe":
        raise ValueError(f"turn_end_scorer={name!r} unknown; use one of {', '.join(SCORERS)}")
    path = Path(probe_path) if probe_path else DEFAULT_PATH
    probe = TurnEndProbe.load(path)
    bound = probe.bind(model_id, token_of, path)
    return ProbeScorer(bound, end_ids, calibration or TurnEndCalibration(probe.complete_at, probe.incomplete_at))


def waits_ms(probabilities: np.ndarray, calibration: TurnEndCalibration, policy: EndpointingPolicy) -> np.ndarray:
    """The silence a pause waits for, for each P a scorer gave it, under `calibration` (what `policy.hangover_for`
    gives the completeness `lm_completeness(calibration.standard(p))`, for many points at once)."""
    p = np.clip(np.asarray(probabilities, dtype=np.float64), 0.0, 1.0)
    standard = np.interp(
        p, [0.0, calibration.incomplete_at, calibration.complete_at, 1.0], [0.0, LM_INCOMPLETE_AT, LM_COMPLETE_AT, 1.0]
    )
    completeness = np.clip(
        INCOMPLETE_AT
        + (standard - LM_INCOMPLETE_AT) / (LM_COMPLETE_AT - LM_INCOMPLETE_AT) * (COMPLETE_AT - INCOMPLETE_AT),
        0.0,
        1.0,
    )
    if policy.fixed_hangover:
        return np.full(p.shape, policy.hangover_ms)
    unsure = np.clip((COMPLETE_AT - completeness) / (COMPLETE_AT - INCOMPLETE_AT), 0.0, 1.0)
    return np.round(policy.min_hangover_ms + unsure * (policy.max_hangover_ms - policy.min_hangover_ms))


def operating_point(
    finished: Sequence[float] | np.ndarray,
    inside: Sequence[float] | np.ndarray,
    calibration: TurnEndCalibration,
    policy: EndpointingPolicy,
) -> dict[str, float | None]:
    """What a calibration does with a scorer's P at the ends of user turns (`finished`) and at the word ends inside
    them (`inside`): how long the finished ones wait, and the share of inside points that would commit within a
    pause of 200, 400 or 600 ms (each such pause there a cut-off)."""
    waits = waits_ms(np.asarray(finished), calibration, policy)
    inner = waits_ms(np.asarray(inside), calibration, policy)
    return {
        "complete_at": round(calibration.complete_at, 4),
        "incomplete_at": round(calibration.incomplete_at, 4),
        "finished_wait_ms_p50": float(np.median(waits)) if waits.size else None,
        "finished_wait_ms_p90": round(float(np.percentile(waits, 90))) if waits.size else None,
        "finished_at_min_hangover": round(float((waits == policy.min_hangover_ms).mean()), 3) if waits.size else None,
        **{
            f"inside_within_{ms}ms": round(float((inner < ms).mean()), 3) if inner.size else None
            for ms in (200, 400, 600)
        },
    }
