"""The learned turn-end probe: P(the user's turn ends after these words) from the logits the reply's prefill computes
anyway at the user's last word, by a logistic probe over chosen next tokens' log-probabilities, trained on real
dialogue (`services/llm/train_turn_probe.py`; sources and figures in services/llm/turn_probe.md).

The probe file names the model it was trained on and the token pieces it reads; a probe that does not match the
loaded model is refused at start, naming both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_PATH = Path(__file__).with_name("turn_probe.npz")


class ProbeMismatch(ValueError):
    """The probe file cannot be used with the loaded model."""


def log_softmax_at(logits: np.ndarray, token_ids: np.ndarray, end_ids: np.ndarray) -> np.ndarray:
    """log P of each of `token_ids`, then log P(any of `end_ids`), then the likeliest token's log P, from one row."""
    scores = logits.astype(np.float64)
    peak = scores.max()
    total = math.log(np.exp(scores - peak).sum()) + peak
    ends = scores[end_ids]
    end_peak = ends.max()
    end_total = math.log(np.exp(ends - end_peak).sum()) + end_peak
    return np.append(scores[token_ids] - total, (end_total - total, peak - total))


@dataclass(frozen=True)
class TurnEndProbe:
    """A logistic probe over a model's state at the user's last word. Its probability is calibrated on held-out
    dialogue; `complete_at`/`incomplete_at` are its operating point (where it means finished and unfinished)."""

    model_id: str
    """The model it reads: architecture, name, width and depth (`model_identity`)."""
    pieces: tuple[str, ...]
    """The token pieces whose log-probabilities it reads."""
    token_weights: np.ndarray
    end_weight: float
    """Weight of log P(the line ends: . ? ! or a line break)."""
    top_weight: float
    """Weight of the likeliest next token's log P (how sure the model is of what comes next)."""
    bias: float
    complete_at: float
    incomplete_at: float

    @classmethod
    def load(cls, path: Path) -> TurnEndProbe:
        if not path.is_file():
            raise ProbeMismatch(f"turn-end probe {path} does not exist")
        with np.load(path, allow_pickle=False) as data:
            return cls(
                model_id=str(data["model_id"]),
                pieces=tuple(str(p) for p in data["pieces"]),
                token_weights=data["token_weights"].astype(np.float64),
                end_weight=float(data["end_weight"]),
                top_weight=float(data["top_weight"]),
                bias=float(data["bias"]),
                complete_at=float(data["complete_at"]),
                incomplete_at=float(data["incomplete_at"]),
            )

    def save(self, path: Path, **provenance: str) -> None:
        arrays: dict[str, np.ndarray] = {
            "model_id": np.array(self.model_id),
            "pieces": np.array(self.pieces),
            "token_weights": self.token_weights.astype(np.float32),
            "end_weight": np.array(self.end_weight),
            "top_weight": np.array(self.top_weight),
            "bias": np.array(self.bias),
            "complete_at": np.array(self.complete_at),
            "incomplete_at": np.array(self.incomplete_at),
        }
        arrays.update({key: np.array(value) for key, value in provenance.items()})
        with path.open("wb") as file:
            np.savez(file, allow_pickle=False, **arrays)

    def bind(self, model_id: str, token_of: Callable[[str], int | None], path: Path) -> BoundProbe:
        """The probe resolved against a loaded model; raises ProbeMismatch naming the probe and the model."""
        if model_id != self.model_id:
            raise ProbeMismatch(
                f"turn-end probe {path} was trained on {self.model_id!r}, the loaded model is {model_id!r}"
            )
        ids = []
        for piece in self.pieces:
            token = token_of(piece)
            if token is None:
                raise ProbeMismatch(f"turn-end probe {path} reads token {piece!r}, which {model_id!r} does not have")
            ids.append(token)
        return BoundProbe(self, np.array(ids, dtype=np.int64))


@dataclass(frozen=True)
class BoundProbe:
    """A probe with its token pieces resolved to one model's ids."""

    probe: TurnEndProbe
    token_ids: np.ndarray

    def probability(self, logits: np.ndarray, end_ids: np.ndarray) -> float:
        """P(turn end) from the row of logits at the user's last word."""
        scores = log_softmax_at(logits, self.token_ids, end_ids)
        return self.from_scores(scores[:-2], float(scores[-2]), float(scores[-1]))

    def from_scores(self, token_logprobs: np.ndarray, end_logprob: float, top_logprob: float) -> float:
        """P(turn end) from the log-probabilities of the probe's tokens, of any line end, and of the likeliest token."""
        probe = self.probe
        z = (
            probe.bias
            + float(token_logprobs @ probe.token_weights)
            + probe.end_weight * end_logprob
            + probe.top_weight * top_logprob
        )
        return 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, z))))


def model_identity(metadata: dict[str, str], n_embd: int) -> str:
    """What names a model for a probe: its architecture, name, size, fine-tune, width and depth from its GGUF metadata
    (the vocabulary may be cut: the probe reads tokens by their pieces, not their ids)."""
    architecture = metadata.get("general.architecture", "?")
    parts = [
        architecture,
        metadata.get("general.basename") or metadata.get("general.name", "?"),
        metadata.get("general.size_label", ""),
        metadata.get("general.finetune", ""),
        f"d{n_embd}",
        f"l{metadata.get(f'{architecture}.block_count', '?')}",
    ]
    return "/".join(part for part in parts if part)
