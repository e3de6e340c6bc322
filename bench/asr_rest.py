"""Whisper's text ending before the speech does, side by side in one run: each utterance decoded once (`once`) and as
the ASR decodes a final (`with_rest`: speech after the last word decoded on its own and appended). `python -m
bench.asr_rest`.

Utterances: the 80 sentences of bench/turn_sentences.py (`piper`) and, with --sgd, user lines of the Schema-Guided
Dialogue test split (`sgd`, longer and more varied), read by Piper at three speeds, clean, 20 dB quieter, with noise
at 15 dB SNR or through the 8 kHz phone band, each ending where its last sound does (as the draft at a pause hears
it); and the recordings of ../shared/audio (`real`). Reported per set: mean WER, lines missing two or more words at
their end, how many needed the rest decoded and what that cost.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np

from bench import print_result
from bench.turn_fusion import CONDITIONS, SPEEDS, TAIL_S, _condition, _lines
from bench.turn_sentences import CHECK, READ, TUNE
from bench.turns import CLIPS, _piper_says
from harness.clips import TRANSCRIPTS
from services.asr.engine import DecodeOptions
from services.asr.whisper_engine import WhisperTranscriber
from services.llm.turn_probe_data import sgd_dialogues
from voicemesh.audio import read_wav, resample, speech_end_ms
from voicemesh.evaluation import word_error_rate, words_of

PAUSE = np.zeros(512, dtype=np.float32)  # the first silent window of a pause


def _read(kind: str, lines: list[str], rng: np.random.Generator) -> list[tuple[str, str, np.ndarray]]:
    spoken = []
    for index, text in enumerate(lines):
        speech = resample(_piper_says(text), int(16000 * SPEEDS[index % len(SPEEDS)]), 16000)
        speech = speech[: int((speech_end_ms(speech, 16000) / 1000 + TAIL_S) * 16000)]
        condition = CONDITIONS[index % len(CONDITIONS)]
        spoken.append((kind, text, np.concatenate([_condition(speech, condition, rng), PAUSE])))
    return spoken


def _utterances(sgd: Path | None, lines: int) -> list[tuple[str, str, np.ndarray]]:
    rng = np.random.default_rng(11)
    spoken = _read("piper", [*TUNE, *CHECK, *READ], rng)
    if sgd is not None:
        dialogues = list(sgd_dialogues(sgd / "test"))
        random.Random("asr-rest").shuffle(dialogues)
        spoken += _read("sgd", [line for _, line in _lines(dialogues, lines, "asr-rest")], rng)
    for clip in sorted(CLIPS.glob("*.wav")):
        audio = read_wav(clip).to_rate(16000).samples
        audio = audio[: int((speech_end_ms(audio, 16000) / 1000 + TAIL_S) * 16000)]
        spoken.append(("real", TRANSCRIPTS[clip.stem], np.concatenate([audio, PAUSE])))
    return spoken


def _short(reference: str, heard: str) -> bool:
    """The decode lost two or more of the reference's words at the end."""
    said, got = words_of(reference), words_of(heard)
    return len(got) <= len(said) - 2 and said[: len(got)][-1:] == got[-1:]


def run(sgd: Path | None = None, lines: int = 150) -> dict[str, object]:
    transcriber = WhisperTranscriber(cpu_threads=2)
    options = DecodeOptions()
    rows: dict[str, list[dict[str, object]]] = {}
    for kind, text, audio in _utterances(sgd, lines):
        once = transcriber.decode_once(audio, options)
        whole = transcriber.transcribe(audio, options)
        rows.setdefault(kind, []).append(
            {
                "reference": text,
                "once": once.text,
                "with_rest": whole.text,
                "wer_once": round(word_error_rate(text, once.text), 3),
                "wer_with_rest": round(word_error_rate(text, whole.text), 3),
                "short_once": _short(text, once.text),
                "short_with_rest": _short(text, whole.text),
                "rest_ms": round(whole.compute_ms - once.compute_ms, 1) if whole.text != once.text else 0.0,
            }
        )
    report: dict[str, object] = {}
    for kind, items in rows.items():
        redone = [r for r in items if r["once"] != r["with_rest"]]
        report[kind] = {
            "utterances": len(items),
            "wer_once": round(float(np.mean([r["wer_once"] for r in items])), 4),
            "wer_with_rest": round(float(np.mean([r["wer_with_rest"] for r in items])), 4),
            "short_once": sum(bool(r["short_once"]) for r in items),
            "short_with_rest": sum(bool(r["short_with_rest"]) for r in items),
            "rest_decoded": len(redone),
            "rest_ms_p50": round(float(np.median([r["rest_ms"] for r in redone])), 1) if redone else 0.0,
            "changed": redone,
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sgd", type=Path, help="the Schema-Guided Dialogue dataset's directory (adds its test lines)")
    parser.add_argument("--lines", type=int, default=150, help="SGD lines (default 150)")
    args = parser.parse_args()
    print_result(run(args.sgd, args.lines))


if __name__ == "__main__":
    main()
