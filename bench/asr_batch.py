"""Would ASR finals that coincide finish sooner as one CTranslate2 batch? Side by side in one run (issue 13).

When several sessions stop speaking at once, their finals reach the ASR together. Three ways to decode k of them
on the same 2 cores, with the embedded tiny.en (int8), each on the same trimmed windows the service decodes (the
audio plus 2 s of padding, greedy, no timestamps):

- `workers`: what the service does under a CPU budget of 2: two decode workers of one thread each, finals
  submitted at once (`WhisperTranscriber(cpu_threads=1, workers=2)`).
- `batched`: one model of two threads; the k windows padded to the longest, one encode and one generate call.
- `sequential`: one model of two threads, one final after another.

Reported per k (1, 2, 4): the median over repeats of when the last final is done (what the slowest session waits
for) and of the mean over finals, and the ratios against `workers`. Word timings (a second pass the service runs
for finals) are left out of every arrangement alike.
`python -m bench.asr_batch [--repeats 7]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from faster_whisper import WhisperModel
from faster_whisper.tokenizer import Tokenizer

from services.asr.whisper_engine import HOP_SAMPLES, PADDING_S, SAMPLE_RATE_HZ, default_model_dir
from voicemesh.audio import read_wav, resample

CLIPS = Path(__file__).resolve().parents[2] / "shared" / "audio"
NAMES = ("spk1_snt1", "spk2_snt1", "wizard", "horizon")


def load_audio(directory: Path = CLIPS) -> list[np.ndarray]:
    """The clips at 16 kHz, each followed by the service's padding."""
    clips = []
    for name in NAMES:
        clip = read_wav(directory / f"{name}.wav")
        audio = resample(clip.samples, clip.rate_hz, SAMPLE_RATE_HZ).astype(np.float32)
        clips.append(np.concatenate([audio, np.zeros(int(PADDING_S * SAMPLE_RATE_HZ), np.float32)]))
    return clips


class Decoder:
    """tiny.en without faster-whisper's 30 s padding: encode and greedy-decode a batch of windows."""

    def __init__(self, threads: int, workers: int = 1) -> None:
        self.model = WhisperModel(
            str(default_model_dir()), device="cpu", compute_type="int8", cpu_threads=threads, num_workers=workers
        )
        self.tokenizer = Tokenizer(self.model.hf_tokenizer, False, task="transcribe", language="en")
        self.prompt = self.model.get_prompt(self.tokenizer, [], without_timestamps=True)

    def decode(self, windows: Sequence[np.ndarray]) -> list[str]:
        """One call for all `windows`, padded with silence to the longest."""
        samples = max(len(window) for window in windows)
        frames = -(-samples // HOP_SAMPLES)
        frames += frames % 2  # the encoder's conv stride is 2
        features = np.stack(
            [
                self.model.feature_extractor(np.pad(window, (0, samples - len(window))), padding=0)[:, :frames]
                for window in windows
            ]
        )
        features = np.pad(features, ((0, 0), (0, 0), (0, frames - features.shape[-1])))
        encoded = self.model.encode(np.ascontiguousarray(features, dtype=np.float32))
        max_new = int(8 + 6 * samples / SAMPLE_RATE_HZ)
        results = self.model.model.generate(
            encoded, [self.prompt] * len(windows), beam_size=1, max_length=len(self.prompt) + max_new
        )
        return [self.tokenizer.decode(result.sequences_ids[0]).strip() for result in results]


def _timed(run: Callable[[], list[tuple[str, float]]]) -> tuple[list[str], float, float]:
    """(texts, when the last was done, mean done), seconds from the start."""
    started = time.monotonic()
    done = [(text, at - started) for text, at in run()]
    return [text for text, _ in done], max(at for _, at in done), statistics.fmean(at for _, at in done)


def arrangements(
    windows: Sequence[np.ndarray], workers: Decoder, single: Decoder, pool: ThreadPoolExecutor
) -> dict[str, Callable[[], list[tuple[str, float]]]]:
    def parallel() -> list[tuple[str, float]]:
        def one(window: np.ndarray) -> tuple[str, float]:
            return workers.decode([window])[0], time.monotonic()

        return list(pool.map(one, windows))

    def batched() -> list[tuple[str, float]]:
        texts = single.decode(windows)
        at = time.monotonic()
        return [(text, at) for text in texts]

    def sequential() -> list[tuple[str, float]]:
        return [(single.decode([window])[0], time.monotonic()) for window in windows]

    return {"workers": parallel, "batched": batched, "sequential": sequential}


def run(repeats: int = 7, sizes: Sequence[int] = (1, 2, 4), directory: Path = CLIPS) -> dict[str, object]:
    audio = load_audio(directory)
    workers, single = Decoder(threads=1, workers=2), Decoder(threads=2)
    results: dict[str, object] = {}
    with ThreadPoolExecutor(2) as pool:
        for k in sizes:
            windows = [audio[index % len(audio)] for index in range(k)]
            ways = arrangements(windows, workers, single, pool)
            for way in ways.values():
                way()  # warm-up
            last: dict[str, list[float]] = {name: [] for name in ways}
            mean: dict[str, list[float]] = {name: [] for name in ways}
            texts: dict[str, list[str]] = {}
            for repeat in range(repeats):
                order = list(ways) if repeat % 2 == 0 else list(reversed(ways))  # interleaved, alternating
                for name in order:
                    texts[name], done_s, mean_s = _timed(ways[name])
                    last[name].append(done_s * 1000)
                    mean[name].append(mean_s * 1000)
            medians = {name: round(statistics.median(values), 1) for name, values in last.items()}
            results[str(k)] = {
                "last_final_ms": medians,
                "mean_final_ms": {name: round(statistics.median(values), 1) for name, values in mean.items()},
                "last_final_over_workers": {
                    name: round(medians[name] / medians["workers"], 3) for name in ways if name != "workers"
                },
                "same_text_as_workers": {name: texts[name] == texts["workers"] for name in ways},
                "texts": texts["workers"],
            }
    return {
        "benchmark": "asr_batch",
        "model": f"tiny.en int8 ({default_model_dir().parent.name})",
        "cpus": len(os.sched_getaffinity(0)),
        "repeats": repeats,
        "clips": list(NAMES),
        "by_finals_at_once": results,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    json.dump(run(args.repeats), sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
