"""How soon the words of speech over a reply are known, with the ASR's partials as captions against partials a
decision waits on (`Urgency.partials`), side by side on one real ASR service under load.

The gateway marks a stream's partials PARTIAL_URGENCY_DECISION while the user speaks over a reply: their words
decide whether it is interrupted ("no wait") or goes on (a backchannel). Captions run on the ASR's niced decoder and
are skipped while decodes queue; decision partials run beside finals on its own workers, behind finals only.

The load: `--streams` other ASR streams speaking real clips in a loop (their finals and captions), and `--burners`
processes spinning at normal priority in the place of the rest of the mesh (the LLM and the TTS take every core
they get when 8 conversations speak). Each round a probe stream speaks one clip twice, once per urgency (the order
alternates); what counts is the time from the probe's first frame of speech to its first partial with a word, and
to its first event with a word at all (a partial or the endpoint candidate). `python -m bench.asr_urgency`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from voicemesh.audio import read_wav
from voicemesh.clients import pcm_frame
from voicemesh.mesh import Mesh, free_port, wait_healthy
from voicemesh.v1 import asr_pb2, asr_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
CLIPS = ROOT.parent / "shared" / "audio"
LOAD_CLIPS = ("wizard", "horizon", "spk1_snt1")
FRAME_MS = 20
URGENCIES = {"captions": asr_pb2.PARTIAL_URGENCY_CAPTIONS, "decision": asr_pb2.PARTIAL_URGENCY_DECISION}


def _frames(name: str) -> list[bytes]:
    return read_wav(CLIPS / f"{name}.wav").to_rate(16000).frames(FRAME_MS)


async def _requests(
    session_id: str, frames: list[bytes], urgency: int, sent: list[float], loop_forever: bool = False
) -> AsyncIterator[asr_pb2.RecognizeRequest]:
    config = asr_pb2.RecognitionConfig(session_id=session_id, sample_rate_hz=16000, interim_results=True)
    yield asr_pb2.RecognizeRequest(config=config)
    yield asr_pb2.RecognizeRequest(urgency=asr_pb2.Urgency(partials=urgency))
    silence = [b"\x00\x00" * 320] * 50
    seq, start = 0, time.monotonic()
    while True:
        for data in frames + silence:
            await asyncio.sleep(max(0.0, start + seq * FRAME_MS / 1000 - time.monotonic()))
            sent.append(time.monotonic())
            yield asr_pb2.RecognizeRequest(frame=pcm_frame(data, 16000, seq))
            seq += 1
        if not loop_forever:
            return


async def _load(stub: asr_pb2_grpc.RecognizerStub, index: int) -> None:
    frames = _frames(LOAD_CLIPS[index % len(LOAD_CLIPS)])
    call = stub.StreamingRecognize(
        _requests(f"load-{index}", frames, asr_pb2.PARTIAL_URGENCY_CAPTIONS, [], loop_forever=True)
    )
    async for _ in call:
        pass


async def _probe(stub: asr_pb2_grpc.RecognizerStub, clip: str, urgency: int, round_index: int) -> dict[str, float]:
    """Milliseconds from the first frame of speech (the VAD's speech start, mapped to when that frame was sent) to
    the first partial with a word, and to the first event with a word."""
    sent: list[float] = []
    call = stub.StreamingRecognize(_requests(f"probe-{round_index}-{urgency}", _frames(clip), urgency, sent))
    result: dict[str, float] = {}
    speech_start = None
    async for event in call:
        kind = event.WhichOneof("event")
        if kind == "speech_started":
            speech_start = sent[min(len(sent) - 1, event.speech_start_ms // FRAME_MS)]
        text = event.partial.text if kind == "partial" else event.endpoint_candidate.text
        if speech_start is None or not text.strip():
            continue
        elapsed_ms = round((time.monotonic() - speech_start) * 1000, 1)
        if kind == "partial":
            result.setdefault("first_partial_ms", elapsed_ms)
        result.setdefault("first_words_ms", elapsed_ms)
        if kind in ("endpoint_candidate", "final"):
            break
    call.cancel()
    return result


async def measure(rounds: int, streams: int, clip: str) -> dict[str, object]:
    mesh = Mesh()
    port = free_port()
    process = mesh.start("asr", port)
    try:
        await wait_healthy(process.target)
        async with grpc.aio.insecure_channel(process.target) as channel:
            stub = asr_pb2_grpc.RecognizerStub(channel)
            load = [asyncio.ensure_future(_load(stub, index)) for index in range(streams)]
            await asyncio.sleep(3)  # the load is under way
            per: dict[str, list[dict[str, float]]] = {name: [] for name in URGENCIES}
            for index in range(rounds):
                order = list(URGENCIES) if index % 2 == 0 else list(reversed(URGENCIES))
                for name in order:
                    per[name].append(await _probe(stub, clip, URGENCIES[name], index))
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
    finally:
        mesh.stop_all()
    summary: dict[str, object] = {}
    for name, results in per.items():
        row: dict[str, object] = {"rounds": len(results)}
        for key in ("first_partial_ms", "first_words_ms"):
            values = [r[key] for r in results if key in r]
            row[f"{key}_p50"] = round(statistics.median(values), 1) if values else None
            row[f"{key}_max"] = max(values) if values else None
            row[f"{key}_missing"] = len(results) - len(values)
        row["per_round"] = results
        summary[name] = row
    captions, decision = summary["captions"], summary["decision"]
    assert isinstance(captions, dict) and isinstance(decision, dict)
    if captions["first_words_ms_p50"] and decision["first_words_ms_p50"]:
        summary["ratio_first_words_p50_captions_over_decision"] = round(
            captions["first_words_ms_p50"] / decision["first_words_ms_p50"], 2
        )
    return summary


def run(rounds: int = 6, streams: int = 3, burners: int = 2, clip: str = "spk2_snt1") -> dict[str, object]:
    if not (CLIPS / f"{clip}.wav").exists():
        return {"skipped": f"no {clip}.wav under {CLIPS}"}
    started = time.monotonic()
    # The rest of the mesh, at normal priority.
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        result = asyncio.run(measure(rounds, streams, clip))
    finally:
        for spinner in spinners:
            spinner.kill()
    result["settings"] = {"rounds": rounds, "streams": streams, "burners": burners, "clip": clip}
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", type=int, default=3, help="other ASR streams speaking in a loop")
    parser.add_argument("--burners", type=int, default=2, help="processes spinning in place of the LLM and TTS")
    parser.add_argument("--clip", default="spk2_snt1", help="what the probe says (a clip in ../shared/audio)")
    args = parser.parse_args()
    json.dump(run(args.rounds, args.streams, args.burners, args.clip), sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
