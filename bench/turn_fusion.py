"""End of turn with its signals fused: false cut-offs against dead air for each signal alone and fused, the fusion
fitted on one split of spoken pauses and checked on the others. `python -m bench.turn_fusion --sgd DIR [--write]`.

Spoken pauses. User lines of real dialogue (the Schema-Guided Dialogue dataset: `fit` from its dev split, `check`
from its test split, no line of either seen by the probe's fit) read by Piper at three speeds, each clean, 20 dB
quieter, with noise at 15 dB SNR, or through the 8 kHz phone band; each cut at its end (finished) and at two word
ends inside it (the speaker goes on). The real recordings of ../shared/audio (`real`, never fitted on) at their end and
at every word end; so are those of each `--recordings DIR` (`unheard`: speech no part of voicemesh was tuned on).
`--read-speech fit|check DIR`: recorded read speech of many voices (`python -m bench.unheard --librispeech`), at its
end where its transcript ends a sentence and at three word ends inside; `fit` is fitted on beside the dialogue lines. At
each point, what the live mesh has at a pause: the draft decode of the audio so far (Whisper tiny.en, as the ASR
decodes it), Smart Turn's P on the same audio, and the LLM's P(turn end) of the decoded words after the dialogue so
far, by both turn-end scorers, on the common scale the LLM replicas send.

Reported, per signal alone and fused: the wait each point gets when the score maps linearly onto the policy's
64-1200 ms between two points of the score, for the pairs that minimise the finished points' mean wait at each bound
on the inside points committing within 600 ms, chosen on `fit` and applied to `check` and `real`; and the LLM's score
alone at its shipped calibration (`shipped`: the mesh without turn_fusion); and each signal's AUC (finished against
inside points) per split. `--write` stores each fusion (but those that weigh a probability against its direction) at
the fewest fit cut-offs whose finished median wait is at most 400 ms, and never at more cut-offs than the LLM's score
alone makes (else at its shortest wait within that), in services/asr/turn_fusion.json (what the ASR's `turn_fusion`
setting loads). The points are cached under --work: a second run only fits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path

import numpy as np

from bench import print_result
from bench.turns import CLIPS
from services.asr.completeness import SmartTurn, doubted
from services.asr.engine import DecodeOptions, WordTiming
from services.asr.fusion import FUSION_PATH, PROBABILITIES, TurnEndFusion, TurnEndFusions
from services.asr.whisper_engine import END_MARKS, WhisperTranscriber
from services.llm.engine import Engine, GenerationRequest, Message
from services.llm.server import LlmSettings, build_engine
from services.llm.turn_probe_data import Dialogue, clean, sgd_dialogues
from voicemesh import config
from voicemesh.audio import read_wav, resample, speech_end_ms
from voicemesh.endpointing import EndpointingPolicy, lm_completeness

SCORERS = ("probe", "line_end")
SPEEDS = (0.9, 1.0, 1.15)
"""Piper's reading resampled to these speeds: a higher or lower voice as well as a faster or slower one."""
CONDITIONS = ("clean", "clean", "quiet20", "noise15", "phone8k")
INSIDE_PER_LINE = 2
INSIDE_PER_READ = 3
"""Word ends taken inside each utterance of read speech (`--read-speech`)."""
CONTEXT_LINES = 4
"""Earlier lines of the dialogue the LLM sees before the user's line, as the live history would hold them."""
CUT_BOUNDS = (0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2)
"""Bounds on the share of inside points committing within 600 ms: one operating point per bound."""
CHOSEN_WAIT_MS = 400
"""The point written with --write: the fewest inside commits within 600 ms whose finished points wait at most this
long at the median, on the fit split, and no more inside commits than the LLM's score alone makes there (a long wait for every unsure pause is no answer: it is dead air after most
finished turns)."""


def _lines(dialogues: list[Dialogue], count: int, seed: str) -> list[tuple[list[Message], str]]:
    """One user line of each of `count` dialogues (4-24 words), with the lines before it as context."""
    rng = random.Random(seed)
    picked: list[tuple[list[Message], str]] = []
    for dialogue in dialogues:
        users = [i for i, (role, text) in enumerate(dialogue.lines) if role == "user" and 4 <= len(text.split()) <= 24]
        if not users:
            continue
        index = rng.choice(users)
        context = [Message(role, clean(text)) for role, text in dialogue.lines[max(0, index - CONTEXT_LINES) : index]]
        picked.append((context, clean(dialogue.lines[index][1])))
        if len(picked) == count:
            break
    return picked


def _condition(audio: np.ndarray, condition: str, rng: np.random.Generator) -> np.ndarray:
    if condition == "quiet20":
        return (audio * 0.1).astype(np.float32)
    if condition == "noise15":
        rms = float(np.sqrt(np.mean(audio**2)))
        return (audio + rng.standard_normal(len(audio)) * rms * 10 ** (-15 / 20)).astype(np.float32)
    if condition == "phone8k":
        return resample(resample(audio, 16000, 8000), 8000, 16000).astype(np.float32)
    return audio


TAIL_S = 0.12
"""Audio kept after a word's end: the VAD's windows before it calls the silence, so a last sound is never cut."""


def _end_of_speech(audio: np.ndarray, words: list[WordTiming]) -> int:
    """The sample a finished utterance's pause starts at: after its last sound and its last word, plus the tail."""
    end_s = max(speech_end_ms(audio, 16000) / 1000, words[-1].end_s if words else 0.0) + TAIL_S
    return min(len(audio), int(end_s * 16000))


def _word_end(words: list[WordTiming], k: int) -> int:
    """The sample a pause after word `k` (1-based) starts at: the tail after it, unless the next word starts first."""
    end_s = words[k - 1].end_s
    return int(max(end_s + 0.03, min(end_s + TAIL_S, words[k].start_s)) * 16000)


class Collector:
    """The engines a pause's signals come from, loaded once."""

    def __init__(self) -> None:
        self.transcriber = WhisperTranscriber(cpu_threads=2)
        self.smart_turn = SmartTurn(threads=1)
        self.llms: dict[str, Engine] = {}

    async def start(self) -> None:
        for scorer in SCORERS:
            settings = dataclasses.replace(config.build(LlmSettings, "llm"), turn_end_scorer=scorer)
            self.llms[scorer] = build_engine(settings)
            await self.llms[scorer].start()

    async def close(self) -> None:
        for engine in self.llms.values():
            await engine.close()

    async def point(self, split: str, name: str, context: list[Message], audio: np.ndarray, finished: bool) -> dict:
        """Every signal at a pause after `audio` (16 kHz, ending where the speech stops)."""
        tail = np.concatenate([audio, np.zeros(512, dtype=np.float32)])  # the 32 ms silent window of a candidate
        draft = self.transcriber.transcribe(tail, DecodeOptions(end_probability=True))
        point: dict[str, object] = {
            "split": split,
            "name": name,
            "finished": finished,
            "text": draft.text,
            "avg_logprob": draft.avg_logprob,
            "no_speech_prob": draft.no_speech_prob,
            "whisper_end": draft.end_probability,
            "doubted": doubted(draft),
            "audio": self.smart_turn.probability(tail),
        }
        for scorer, engine in self.llms.items():
            text = draft.text.strip()
            if not text:
                point[scorer] = 0.0
                continue
            request = GenerationRequest(f"{name}-{scorer}", [*context, Message("user", text)], 1, score_turn_end=True)
            scores = [c.turn_end async for c in engine.generate(request) if c.turn_end is not None]
            raw = scores[0]
            point[scorer] = engine.turn_end_calibration.standard(raw)
        return point

    async def recordings(self, split: str, clips: list[Path], inside: int | None = None) -> list[dict]:
        """Each recording at the pauses `pauses_of` takes from its transcript."""
        points = []
        for clip in clips:
            audio = read_wav(clip).to_rate(16000).samples
            transcript = self.transcriber.transcribe(audio)
            words = transcript.words
            audio = audio[: _end_of_speech(audio, words)]
            finished, ends = pauses_of(transcript.text, words, inside, clip.stem)
            if finished:
                points.append(await self.point(split, clip.stem, [], audio, True))
            for k in ends:
                points.append(await self.point(split, f"{clip.stem}/{k}", [], audio[: _word_end(words, k)], False))
        return points


def pauses_of(text: str, words: Sequence[WordTiming], inside: int | None, seed: str) -> tuple[bool, list[int]]:
    """Where a recording is cut: whether at its end (finished), and after which words (1-based; the speaker goes on).

    Without `inside`, a recording of one finished utterance: its end and every word end. With it, recorded speech
    labelled by its transcript: its end only when the text ends with a full stop, question or exclamation mark, and
    `inside` word ends drawn (seeded) from those not after such a mark, where the speaker may have been done."""
    ends = list(range(1, len(words)))
    if inside is None:
        return True, ends
    ends = [k for k in ends if not words[k - 1].text.rstrip().endswith(END_MARKS)]
    drawn = sorted(random.Random(seed).sample(ends, min(inside, len(ends))))
    return text.rstrip().endswith(END_MARKS), drawn


async def collect(sgd: Path, lines_per_split: int) -> list[dict]:
    """Every point of every split."""
    from bench.turns import _piper_says

    collector = Collector()
    await collector.start()
    rng = np.random.default_rng(5)
    points: list[dict] = []
    try:
        for split, source in (("fit", "dev"), ("check", "test")):
            dialogues = list(sgd_dialogues(sgd / source))
            random.Random(f"fusion-{source}").shuffle(dialogues)
            for index, (context, line) in enumerate(_lines(dialogues, lines_per_split, split)):
                speed = SPEEDS[index % len(SPEEDS)]
                condition = CONDITIONS[index % len(CONDITIONS)]
                speech = resample(_piper_says(line), int(16000 * speed), 16000)
                words = collector.transcriber.transcribe(speech).words
                speech = speech[: _end_of_speech(speech, words)]
                audio = _condition(speech, condition, rng)
                name = f"{split}{index:03d}-{condition}-x{speed:g}"
                points.append(await collector.point(split, name, context, audio, True))
                ends = list(range(1, len(words)))
                for k in sorted(random.Random(name).sample(ends, min(INSIDE_PER_LINE, len(ends)))):
                    points.append(
                        await collector.point(split, f"{name}/{k}", context, audio[: _word_end(words, k)], False)
                    )
        points += await collector.recordings("real", sorted(CLIPS.glob("*.wav")))
    finally:
        await collector.close()
    return points


async def collect_recordings(clips: list[Path], split: str = "unheard", inside: int | None = None) -> list[dict]:
    """The points of these recordings (see `Collector.recordings`)."""
    collector = Collector()
    await collector.start()
    try:
        return await collector.recordings(split, clips, inside)
    finally:
        await collector.close()


def waits(
    z: np.ndarray, vetoed: np.ndarray, high: float, low: float, policy: EndpointingPolicy, alone: np.ndarray
) -> np.ndarray:
    """The hangover each score gets when `high` maps to the short wait and `low` to the long one (a vetoed point:
    the long one), as the ASR applies a fusion's operating point; where a signal is missing (z is NaN), `alone`:
    the wait the LLM's score alone gives."""
    unsure = np.clip((high - np.nan_to_num(z)) / (high - low), 0.0, 1.0)
    unsure[vetoed] = 1.0
    w = np.round(policy.min_hangover_ms + unsure * (policy.max_hangover_ms - policy.min_hangover_ms))
    return np.where(np.isnan(z), alone, w)


def outcome(w: np.ndarray, finished: np.ndarray) -> dict[str, float]:
    done, inside = w[finished], w[~finished]
    return {
        "finished_wait_ms_p50": float(np.median(done)),
        "finished_wait_ms_p90": float(np.percentile(done, 90)),
        "finished_at_short_wait": round(float(np.mean(done <= 64)), 3),
        **{f"inside_within_{ms}ms": round(float(np.mean(inside < ms)), 3) for ms in (200, 400, 600)},
    }


def curve(fusion: TurnEndFusion, points: dict[str, list[dict]], policy: EndpointingPolicy) -> list[dict[str, object]]:
    """Per bound on the fit split's inside-within-600 ms share, the operating point that gives the fit split's
    finished points the lowest mean wait, and what it does on every split."""
    text = fusion.text_scorer or "line_end"
    scored = {
        split: (fusion.logits(ps), _finished(ps), _vetoed(ps), _shipped_waits(ps, text, policy))
        for split, ps in points.items()
    }
    z, finished, vetoed, alone = scored["fit"]
    grid = np.percentile(z[~np.isnan(z)], np.linspace(2, 98, 49))
    rows = []
    for bound in CUT_BOUNDS:
        best: tuple[float, float, float] | None = None
        for high in grid:
            for low in grid[grid < high]:
                w = waits(z, vetoed, high, low, policy, alone)
                if np.mean(w[~finished] < 600) > bound:
                    continue
                mean = float(np.mean(w[finished]))
                if best is None or mean < best[0]:
                    best = (mean, float(high), float(low))
        if best is None:
            continue
        _, high, low = best
        rows.append(
            {
                "bound": bound,
                "high": round(high, 4),
                "low": round(low, 4),
                **{
                    split: outcome(waits(z_, v_, high, low, policy, a_), f_)
                    for split, (z_, f_, v_, a_) in scored.items()
                },
            }
        )
    return rows


def _shipped_waits(points: list[dict], scorer: str, policy: EndpointingPolicy) -> np.ndarray:
    """The waits the LLM's score alone gives (no fusion), with the ASR's veto, as the mesh runs without turn_fusion."""
    waits = [policy.hangover_for(lm_completeness(p[scorer])) for p in points]
    return np.where(_vetoed(points), policy.max_hangover_ms, np.array(waits))


def _finished(points: list[dict]) -> np.ndarray:
    return np.array([p["finished"] for p in points])


def _vetoed(points: list[dict]) -> np.ndarray:
    return np.array([p["doubted"] is not None for p in points])


def signals() -> dict[str, tuple[str, ...]]:
    """Each signal alone, then the fusions (names of FEATURES)."""
    return {
        "text_line_end": ("line_end",),
        "text_probe": ("probe",),
        "audio": ("audio",),
        "asr_confidence": ("avg_logprob",),
        "whisper_end": ("whisper_end",),
        "line_end+confidence": ("line_end", "avg_logprob"),
        "probe+confidence": ("probe", "avg_logprob"),
        "line_end+audio+confidence": ("line_end", "audio", "avg_logprob"),
        "probe+audio+confidence": ("probe", "audio", "avg_logprob"),
        "line_end+whisper_end+confidence": ("line_end", "whisper_end", "avg_logprob"),
        "probe+whisper_end+confidence": ("probe", "whisper_end", "avg_logprob"),
        "line_end+audio+whisper_end+confidence": ("line_end", "audio", "whisper_end", "avg_logprob"),
        "probe+audio+whisper_end+confidence": ("probe", "audio", "whisper_end", "avg_logprob"),
    }


def _cached(path: Path, make: Callable[[], Coroutine[None, None, list[dict]]]) -> list[dict]:
    if path.exists():
        return [json.loads(line) for line in path.read_text().splitlines()]
    points = asyncio.run(make())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p) + "\n" for p in points))
    return points


def auc(score: np.ndarray, finished: np.ndarray) -> float | None:
    """P(a finished point scores above an inside one), ties half; points without the score are left out."""
    known = ~np.isnan(score)
    done, inside = score[known & finished], score[known & ~finished]
    if not len(done) or not len(inside):
        return None
    above = (done[:, None] > inside[None, :]).mean() + 0.5 * (done[:, None] == inside[None, :]).mean()
    return round(float(above), 3)


def run(
    sgd: Path,
    lines_per_split: int,
    work: Path,
    write: bool,
    recordings: Sequence[Path] = (),
    read_speech: Mapping[str, Path] | None = None,
) -> dict[str, object]:
    points = _cached(work / "points.jsonl", lambda: collect(sgd, lines_per_split))
    for directory in recordings:
        clips = sorted(directory.glob("*.wav"))
        points += _cached(work / f"unheard-{directory.resolve().name}.jsonl", lambda c=clips: collect_recordings(c))
    for split, directory in (read_speech or {}).items():
        clips = sorted(directory.glob("*.wav"))
        points += _cached(
            work / f"{split}-{directory.resolve().name}.jsonl",
            lambda c=clips, s=split: collect_recordings(c, s, INSIDE_PER_READ),
        )
    by_split: dict[str, list[dict]] = {}
    for point in points:
        by_split.setdefault(point["split"], []).append(point)
    if "read_fit" in by_split:  # real voices join the dialogue lines Piper read: fitted and chosen on together
        by_split["fit"] = by_split["fit"] + by_split["read_fit"]
    policy = EndpointingPolicy()
    report: dict[str, object] = {
        "points": {
            s: {"finished": sum(p["finished"] for p in ps), "inside": sum(not p["finished"] for p in ps)}
            for s, ps in by_split.items()
        },
    }
    fits: dict[str, TurnEndFusion] = {}
    curves: dict[str, object] = {}
    for name, features in signals().items():
        fusion = TurnEndFusion.fit(name, features, by_split["fit"])
        fits[name] = fusion
        curves[name] = {
            "weights": fusion.weights_by_name(),
            "auc": {split: auc(fusion.logits(ps), _finished(ps)) for split, ps in by_split.items()},
            "curve": curve(fusion, by_split, policy),
        }
    report["signals"] = curves
    report["shipped"] = {
        scorer: {split: outcome(_shipped_waits(ps, scorer, policy), _finished(ps)) for split, ps in by_split.items()}
        for scorer in SCORERS
    }
    if write:
        chosen = []
        for name, fusion in fits.items():
            backwards = [
                f for f, w in zip(fusion.features, fusion.weights, strict=True) if f in PROBABILITIES and w <= 0
            ]
            if "+" not in name or backwards:  # a higher P(finished) read as less finished: adds nothing to the rest
                continue
            # Never more inside commits than the LLM's score alone makes (on fit): else the fusion is no better.
            alone = report["shipped"][fusion.text_scorer]["fit"]["inside_within_600ms"]
            rows = [r for r in curves[name]["curve"] if r["fit"]["inside_within_600ms"] <= alone]
            row = next((r for r in rows if r["fit"]["finished_wait_ms_p50"] <= CHOSEN_WAIT_MS), None)
            row = row or min(rows, key=lambda r: r["fit"]["finished_wait_ms_p50"], default=None)
            if row is not None:
                chosen.append(dataclasses.replace(fusion, complete_at=row["high"], incomplete_at=row["low"]))
        TurnEndFusions(tuple(chosen)).save(FUSION_PATH)
        report["written"] = str(FUSION_PATH)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sgd", type=Path, required=True, help="the Schema-Guided Dialogue dataset's directory")
    parser.add_argument("--lines", type=int, default=150, help="dialogue lines per split (default 150)")
    parser.add_argument(
        "--work", type=Path, default=Path.home() / ".cache" / "voicemesh" / "turn-fusion", help="points cache"
    )
    parser.add_argument("--write", action="store_true", help="store the fusions in services/asr/turn_fusion.json")
    parser.add_argument(
        "--recordings",
        type=Path,
        action="append",
        default=[],
        help="a directory of more recorded finished utterances (16-bit WAV), never fitted on: split `unheard`",
    )
    parser.add_argument(
        "--read-speech",
        nargs=2,
        action="append",
        default=[],
        metavar=("PART", "DIR"),
        help="recorded read speech labelled by its transcript (python -m bench.unheard --librispeech): PART `fit` is "
        "fitted on beside the dialogue lines, `check` only reported (splits read_fit, read_check)",
    )
    args = parser.parse_args()
    read: dict[str, Path] = {}
    for part, directory in args.read_speech:
        if part not in ("fit", "check"):
            parser.error(f"--read-speech {part}: PART is fit or check")
        read[f"read_{part}"] = Path(directory)
    print_result(run(args.sgd, args.lines, args.work, args.write, args.recordings, read))


if __name__ == "__main__":
    main()
