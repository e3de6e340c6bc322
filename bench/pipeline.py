"""Voice-to-voice latency of the whole mesh, three pipelines side by side in one run (same clips, same models):

  (a) naive:    wait for 200 ms of trailing silence, then transcribe the whole clip with a 30 s window, generate
                the whole reply, synthesize the whole reply, then send;
  (b) sentence: the same endpointing and ASR, but LLM deltas stream into TTS per sentence, audio streams out;
  (c) all on:   the gateway's defaults: final ASR pass on the trimmed window started at the first silence,
                speculative start on the endpoint candidate, word chunking (k=2), streaming, and the LLM's prefill
                of the partial transcripts' words while the user speaks (`c_no_prefill`: all of it but that).

V2V per turn = first reply audio frame received by the client - send time of the clip's last speech frame. A
clip the gateway cut into several turns (a pause inside it ended a turn: the fixed 200 ms hangover of (a) and (b)
cuts spk1_snt1 before "the small dog") counts its last turn, the reply to the whole utterance, and the cut goes
into `split_clips`; a clip with no answered turn is a failed turn.
Modes are interleaved round by round so drift in machine load hits all alike. `python -m bench.pipeline`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench import print_result
from voicemesh.audio import read_wav
from voicemesh.conversation import TalkTurn, talk
from voicemesh.mesh import local_mesh
from voicemesh.v1 import asr_pb2, conversation_pb2, tts_pb2

ROOT = Path(__file__).resolve().parents[1]
CLIPS = ROOT.parent / "shared" / "audio"
DEFAULT_CLIPS = ("spk1_snt1", "spk2_snt1", "wizard", "horizon")
NAIVE_ENDPOINTING = asr_pb2.EndpointingConfig(candidate_silence_ms=200, hangover_ms=200, fixed_hangover=True)

MODES = {
    "a_naive": conversation_pb2.PipelineOptions(
        speculative_start=False,
        prefill_partials=False,
        tts_chunking=tts_pb2.CHUNKING_POLICY_WHOLE,
        asr_decode_window=asr_pb2.DECODE_WINDOW_FULL,
        asr_final_at_silence=False,
        buffer_whole_reply=True,
        endpointing=NAIVE_ENDPOINTING,
    ),
    "b_sentence": conversation_pb2.PipelineOptions(
        speculative_start=False,
        prefill_partials=False,
        tts_chunking=tts_pb2.CHUNKING_POLICY_SENTENCE,
        asr_decode_window=asr_pb2.DECODE_WINDOW_FULL,
        asr_final_at_silence=False,
        endpointing=NAIVE_ENDPOINTING,
    ),
    "c_all_on": conversation_pb2.PipelineOptions(),  # the gateway's defaults
    # (c) without the LLM's prefill of partial transcripts (not in the default run).
    "c_no_prefill": conversation_pb2.PipelineOptions(prefill_partials=False),
    # (c) with replies started only at the first silence, not on a partial the LLM scores finished.
    "c_no_partial_start": conversation_pb2.PipelineOptions(start_on_partials=False),
    # (c) with the old fixed 288 ms hangover instead of the completeness-scored one (not in the default run).
    "c_fixed_hangover": conversation_pb2.PipelineOptions(endpointing=asr_pb2.EndpointingConfig(fixed_hangover=True)),
}
DEFAULT_MODES = ("a_naive", "b_sentence", "c_all_on")


@dataclass(frozen=True)
class MeasuredTurn:
    """One turn that reached reply audio: the clip spoken and the turn as the client saw it."""

    clip: str
    turn: TalkTurn
    v2v_ms: float  # to 0.1 ms, as printed per turn
    server: conversation_pb2.TurnMetrics  # the gateway's own metrics of the turn

    def to_json(self) -> dict[str, object]:
        """The turn as printed under `per_turn`."""
        return {**self.turn.as_dict(), "clip": self.clip}


@dataclass(frozen=True)
class ModeSummary:
    """One mode over all its turns; the field names are the JSON keys."""

    turns: int
    failed_turns: int
    split_clips: int
    """Clips the gateway ended a turn inside (the user would have been cut off)."""
    v2v_p50_ms: float | None
    v2v_p95_ms: float | None
    v2v_max_ms: float | None
    stage_medians_ms: dict[str, float]
    speculative_used: int
    speculative_discarded: int
    completion_tokens_median: float | None

    @classmethod
    def of(cls, rows: list[MeasuredTurn], failed_turns: int, split_clips: int) -> ModeSummary:
        v2v = [row.v2v_ms for row in rows]
        stages = (
            {
                key: round(statistics.median(row.turn.stages_ms[key] for row in rows), 1)
                for key in rows[0].turn.stages_ms
            }
            if rows
            else {}
        )
        return cls(
            turns=len(v2v),
            failed_turns=failed_turns,
            split_clips=split_clips,
            v2v_p50_ms=round(float(np.percentile(v2v, 50)), 1) if v2v else None,
            v2v_p95_ms=round(float(np.percentile(v2v, 95)), 1) if v2v else None,
            v2v_max_ms=max(v2v) if v2v else None,
            stage_medians_ms=stages,
            speculative_used=sum(1 for row in rows if row.server.speculative_used),
            speculative_discarded=sum(row.server.speculative_discarded for row in rows),
            completion_tokens_median=statistics.median(row.server.completion_tokens for row in rows) if rows else None,
        )

    def to_json(self) -> dict[str, object]:
        return asdict(self)


async def _turn(
    target: str, clip_name: str, options: conversation_pb2.PipelineOptions
) -> tuple[MeasuredTurn | None, bool]:
    """The clip's answered turn (its last, if the gateway cut the clip into several), and whether it was cut."""
    config = conversation_pb2.SessionConfig(input_sample_rate_hz=16000, output_sample_rate_hz=16000, options=options)
    turns, _, _ = await talk(target, read_wav(CLIPS / f"{clip_name}.wav"), config, trailing_silence_s=2.5)
    split = len(turns) > 1
    # A turn with V2V has its metrics too (V2V is measured from the speech end they carry).
    if not turns or (v2v_ms := turns[-1].v2v_ms) is None or turns[-1].metrics is None:
        return None, split
    return MeasuredTurn(clip_name, turns[-1], round(v2v_ms, 1), turns[-1].metrics.server), split


async def measure(target: str, modes: list[str], clips: list[str], rounds: int) -> dict[str, object]:
    rows: dict[str, list[MeasuredTurn]] = {mode: [] for mode in modes}
    failed: dict[str, int] = dict.fromkeys(modes, 0)
    split: dict[str, int] = dict.fromkeys(modes, 0)
    for _ in range(rounds):
        for clip in clips:
            for mode in modes:
                row, was_split = await _turn(target, clip, MODES[mode])
                split[mode] += was_split
                if row is None:
                    failed[mode] += 1
                else:
                    rows[mode].append(row)
    summaries = {mode: ModeSummary.of(rows[mode], failed[mode], split[mode]) for mode in modes}
    result: dict[str, object] = {mode: summary.to_json() for mode, summary in summaries.items()}
    if "a_naive" in summaries and "c_all_on" in summaries:
        a, c = summaries["a_naive"].v2v_p50_ms, summaries["c_all_on"].v2v_p50_ms
        result["ratio_p50_naive_over_all_on"] = round(a / c, 2) if a and c else None
    result["per_turn"] = {mode: [row.to_json() for row in mode_rows] for mode, mode_rows in rows.items()}
    return result


def run(
    modes: list[str] | None = None, clips: list[str] | None = None, rounds: int = 3, target: str = ""
) -> dict[str, object]:
    modes = modes or list(DEFAULT_MODES)
    clips = [c for c in (clips or DEFAULT_CLIPS) if (CLIPS / f"{c}.wav").exists()]
    if not clips:
        return {"skipped": f"no clips under {CLIPS}"}
    if target:
        return asyncio.run(measure(target, modes, clips, rounds))
    with local_mesh("voicemesh-bench-") as gateway:
        return asyncio.run(measure(gateway, modes, clips, rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {','.join(MODES)}")
    parser.add_argument("--clips", default=",".join(DEFAULT_CLIPS))
    parser.add_argument("--rounds", type=int, default=3, help="each clip is spoken this many times per mode")
    parser.add_argument("--target", default="", help="an already running gateway instead of a fresh mesh")
    parser.add_argument("--per-turn", action="store_true", help="include every turn in the output")
    args = parser.parse_args()
    result = run(args.modes.split(","), args.clips.split(","), args.rounds, args.target)
    print_result(result, drop=None if args.per_turn else "per_turn")


if __name__ == "__main__":
    main()
