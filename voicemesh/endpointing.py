"""End-of-turn settings: the one definition of their defaults and ranges, read by the gateway (which refuses a
bad session config up front), the ASR (which applies it) and the LLM service (which puts its model's turn-end
score on the scale they use)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from voicemesh.errors import invalid
from voicemesh.v1 import asr_pb2


@dataclass(frozen=True)
class EndpointingPolicy:
    """When a pause ends a turn. Durations in milliseconds of audio, counted in 32 ms VAD windows."""

    vad_threshold: float = 0.5
    """Speech probability above which a window is speech (a window below threshold-0.15 is silence)."""
    candidate_silence_ms: int = 32
    """Silence after speech that makes an endpoint candidate: the final decode and a speculative reply start
    at the first silent window, whatever the hangover turns out to be."""
    hangover_ms: int = 288
    """The fixed hangover: used when `fixed_hangover` is set, and whenever the pause's completeness score is
    not in by then (a slow or failing scorer never holds a turn open). Nine windows (docs/decisions/0003)."""
    min_speech_ms: int = 96
    """Speech needed to open a turn or to end a pause in one; shorter blips (clicks, breaths) are ignored."""
    min_hangover_ms: int = 64
    """The wait after a pause a language model scored complete (a TurnScore). Scores from the transcript's ending
    or the audio model never go below `hangover_ms`: both call clause ends of read speech complete. The LLM's score
    usually comes later than this, so it keeps only a score that comes sooner from committing within two windows
    (docs/decisions/0004)."""
    max_hangover_ms: int = 1200
    """The wait after a pause scored incomplete: mid-sentence pauses of real speakers run to 600-800 ms."""
    fixed_hangover: bool = False
    """Commit after exactly `hangover_ms` of silence, without a completeness score (the baseline)."""
    score_budget_ms: int = 500
    """How long a pause waits for a language model's score the client said is coming (it comes after the draft
    decode and the LLM's prefill, later when the LLM is busy); past the budget the transcript's score and the fixed
    hangover apply."""

    def hangover_for(self, completeness: float | None) -> int:
        """The silence that commits a pause whose completeness score is `completeness` (None: not scored)."""
        if self.fixed_hangover or completeness is None:
            return self.hangover_ms
        # Sure it is complete: the short wait; sure it is not: the long one; in between, longer when less sure.
        unsure = min(1.0, max(0.0, (COMPLETE_AT - completeness) / (COMPLETE_AT - INCOMPLETE_AT)))
        return round(self.min_hangover_ms + unsure * (self.max_hangover_ms - self.min_hangover_ms))


COMPLETE_AT = 0.7
"""A completeness score at or above this takes the short wait: with the default fusion, "Whisper ended the sentence
and Smart Turn did not object" (docs/decisions/0005)."""
INCOMPLETE_AT = 0.55
"""At or below this, the long wait; unsure scores in between wait 64-1200 ms, longer when less sure."""


LM_COMPLETE_AT = 0.45
"""On the common scale every LLM replica sends, the P(turn end) at or above which a turn takes the short wait: where
Gemma 3 270M's line-end score means finished (docs/decisions/0004, 0024)."""
LM_INCOMPLETE_AT = 0.2
"""At or below this, the long wait; between the two the wait grows linearly as P falls (docs/decisions/0004)."""


@dataclass(frozen=True)
class TurnEndCalibration:
    """Where one language model's P(turn end) means finished and unfinished. LM_COMPLETE_AT and LM_INCOMPLETE_AT
    were measured on Gemma 3 270M; another model puts the same sentences elsewhere on its own scale. An LLM
    replica maps its model's probability onto theirs (`standard`) before it sends it, so the gateway and the ASR
    use one scale whichever model scored. Choose a model's two points with `python -m bench.turn_text` on that
    model's engine: its `calibrations` table gives, per candidate pair, how long finished sentences wait and how many
    points inside sentences would commit within a 200, 400 or 600 ms pause."""

    complete_at: float = LM_COMPLETE_AT
    """This model's P at and above which a turn is taken as finished (the short wait)."""
    incomplete_at: float = LM_INCOMPLETE_AT
    """This model's P at and below which a turn is taken as unfinished (the longest wait)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.incomplete_at < self.complete_at < 1.0:  # NaN fails too
            raise ValueError(
                f"turn_end_incomplete_at={self.incomplete_at:g} and turn_end_complete_at={self.complete_at:g}: "
                "send 0 < incomplete_at < complete_at < 1"
            )

    def standard(self, probability: float) -> float:
        """`probability` on the scale of LM_COMPLETE_AT and LM_INCOMPLETE_AT: this model's two points go onto
        theirs, linearly between them and out to 0 and 1 (the identity for Gemma 3 270M's own points)."""
        p = min(1.0, max(0.0, probability))
        for (x0, y0), (x1, y1) in itertools.pairwise(
            ((0.0, 0.0), (self.incomplete_at, LM_INCOMPLETE_AT), (self.complete_at, LM_COMPLETE_AT), (1.0, 1.0))
        ):
            if p <= x1:
                return y0 + (p - x0) * (y1 - y0) / (x1 - x0)
        return 1.0


def lm_completeness(probability: float) -> float:
    """A language model's P(turn end) on the completeness scale of `hangover_for`: its thresholds map onto
    COMPLETE_AT and INCOMPLETE_AT, linearly between them."""
    position = (probability - LM_INCOMPLETE_AT) / (LM_COMPLETE_AT - LM_INCOMPLETE_AT)
    return min(1.0, max(0.0, INCOMPLETE_AT + position * (COMPLETE_AT - INCOMPLETE_AT)))


def policy_from(message: asr_pb2.EndpointingConfig) -> EndpointingPolicy:
    """The policy a request asks for (zero fields: defaults); raises INVALID_ARGUMENT naming a bad field."""
    default = EndpointingPolicy()
    policy = EndpointingPolicy(
        vad_threshold=message.vad_threshold or default.vad_threshold,
        candidate_silence_ms=message.candidate_silence_ms or default.candidate_silence_ms,
        hangover_ms=message.hangover_ms or default.hangover_ms,
        min_speech_ms=message.min_speech_ms or default.min_speech_ms,
        # Unset, it follows a longer candidate_silence_ms (a pause is never committed before it is a candidate).
        min_hangover_ms=message.min_hangover_ms or max(default.min_hangover_ms, message.candidate_silence_ms),
        max_hangover_ms=message.max_hangover_ms or default.max_hangover_ms,
        fixed_hangover=message.fixed_hangover,
        score_budget_ms=message.score_budget_ms or default.score_budget_ms,
    )
    if not 0.05 <= policy.vad_threshold <= 0.95:
        raise invalid(f"endpointing.vad_threshold={policy.vad_threshold:g} out of range; send 0.05-0.95")
    for name in ("candidate_silence_ms", "hangover_ms", "min_hangover_ms", "max_hangover_ms", "score_budget_ms"):
        value = getattr(policy, name)
        if not 32 <= value <= 10000:
            raise invalid(f"endpointing.{name}={value} out of range; send 32-10000")
    if not 32 <= policy.min_speech_ms <= 2000:
        raise invalid(f"endpointing.min_speech_ms={policy.min_speech_ms} out of range; send 32-2000")
    if policy.fixed_hangover:
        if policy.hangover_ms < policy.candidate_silence_ms:
            raise invalid(
                f"endpointing.hangover_ms={policy.hangover_ms} is shorter than candidate_silence_ms="
                f"{policy.candidate_silence_ms}; the hangover must be at least as long"
            )
        return policy
    if not policy.candidate_silence_ms <= policy.min_hangover_ms <= policy.hangover_ms <= policy.max_hangover_ms:
        raise invalid(
            "endpointing needs candidate_silence_ms <= min_hangover_ms <= hangover_ms <= max_hangover_ms; got "
            f"candidate_silence_ms={policy.candidate_silence_ms}, min_hangover_ms={policy.min_hangover_ms}, "
            f"hangover_ms={policy.hangover_ms}, max_hangover_ms={policy.max_hangover_ms}"
        )
    return policy


def to_proto(policy: EndpointingPolicy) -> asr_pb2.EndpointingConfig:
    """Every field explicit, so the ASR applies exactly what the gateway checked."""
    return asr_pb2.EndpointingConfig(
        vad_threshold=policy.vad_threshold,
        candidate_silence_ms=policy.candidate_silence_ms,
        hangover_ms=policy.hangover_ms,
        min_speech_ms=policy.min_speech_ms,
        min_hangover_ms=policy.min_hangover_ms,
        max_hangover_ms=policy.max_hangover_ms,
        fixed_hangover=policy.fixed_hangover,
        score_budget_ms=policy.score_budget_ms,
    )
