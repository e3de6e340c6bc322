"""Smart Turn's P as a pause goes on: does scoring later in the pause separate finished utterances from pauses inside
them better than scoring at its first silent window, where the ASR scores it? `python -m bench.smart_turn_pause
--read-speech DIR --recordings DIR`.

Each recording is cut as `python -m bench.turn_fusion` cuts it (`pauses_of`): `--read-speech` at its end where its
transcript ends a sentence and at three word ends inside; `--recordings` (finished utterances) at the end and at every
word end. After each cut, room tone at the recording's own floor for each `--after` length, and Smart Turn scores the
audio up to there. Reported per set and length: the AUC (finished against inside), both medians, and the share of
finished points scoring above all but 3% (5%) of the inside ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench import print_result
from bench.turn_fusion import INSIDE_PER_READ, _end_of_speech, _word_end, auc, pauses_of
from services.asr.completeness import SmartTurn
from services.asr.whisper_engine import WhisperTranscriber
from voicemesh.audio import block_levels_db, noise_floor_db, read_wav

AFTER_MS = (32, 100, 200, 300, 500)


def room_tone(audio: np.ndarray, ms: int, rng: np.random.Generator) -> np.ndarray:
    """`ms` of noise at the level of the 16 kHz recording's noise floor (`noise_floor_db`)."""
    floor_db = noise_floor_db(block_levels_db(audio, 16000))
    rms = 10 ** (floor_db / 20) if floor_db > -120 else 0.0
    return (rng.standard_normal(ms * 16) * rms).astype(np.float32)


def score_set(
    clips: list[Path], inside: int | None, after_ms: tuple[int, ...], transcriber: WhisperTranscriber, model: SmartTurn
) -> dict[str, object]:
    rng = np.random.default_rng(3)
    finished: list[bool] = []
    scores: list[list[float]] = []
    for clip in clips:
        audio = read_wav(clip).to_rate(16000).samples
        transcript = transcriber.transcribe(audio)
        words = transcript.words
        if not words:
            continue
        audio = audio[: _end_of_speech(audio, words)]
        done, ends = pauses_of(transcript.text, words, inside, clip.stem)
        cuts = ([(True, audio)] if done else []) + [(False, audio[: _word_end(words, k)]) for k in ends]
        for label, cut in cuts:
            finished.append(label)
            scores.append([model.probability(np.concatenate([cut, room_tone(audio, ms, rng)])) for ms in after_ms])
    labels, table = np.array(finished), np.array(scores)
    rows = {}
    for column, ms in enumerate(after_ms):
        p = table[:, column]
        done, inside_p = p[labels], p[~labels]
        rows[f"{ms}ms"] = {
            "auc": auc(p, labels),
            "finished_median": round(float(np.median(done)), 3),
            "inside_median": round(float(np.median(inside_p)), 3),
            "finished_above_inside_p97": round(float(np.mean(done > np.quantile(inside_p, 0.97))), 3),
            "finished_above_inside_p95": round(float(np.mean(done > np.quantile(inside_p, 0.95))), 3),
        }
    return {"finished": int(labels.sum()), "inside": int((~labels).sum()), "by_pause": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--read-speech", type=Path, help="read speech (`python -m bench.unheard --librispeech check`)")
    parser.add_argument("--recordings", type=Path, help="recordings of finished utterances (`python -m bench.unheard`)")
    parser.add_argument(
        "--after", default=",".join(map(str, AFTER_MS)), help="pause lengths scored, ms (default %(default)s)"
    )
    args = parser.parse_args()
    if args.read_speech is None and args.recordings is None:
        parser.error("give --read-speech DIR, --recordings DIR or both")
    after_ms = tuple(int(ms) for ms in args.after.split(","))
    transcriber, model = WhisperTranscriber(cpu_threads=2), SmartTurn(threads=2)
    result: dict[str, object] = {"after_ms": list(after_ms)}
    for name, directory, inside in (
        ("read_speech", args.read_speech, INSIDE_PER_READ),
        ("recordings", args.recordings, None),
    ):
        if directory is not None:
            clips = sorted(directory.glob("*.wav"))
            result[name] = score_set(clips, inside, after_ms, transcriber, model)
    print_result(result)


if __name__ == "__main__":
    main()
