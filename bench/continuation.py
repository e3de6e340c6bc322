"""A turn committed in a pause inside the utterance, through the whole mesh: is the utterance still answered whole?

The end-of-turn policy sometimes commits in a pause inside an utterance (`python -m bench.turns` counts these as
false cut-offs). The gateway then starts the reply; when the user goes on before a word of it was heard, the words
after the pause continue the turn (`PipelineOptions.continue_unheard_turns`): one reply answers the whole. This
runs the utterances of bench.turns that have a pause inside them (each real clip with 200-800 ms spliced in at its
middle word boundary; each clip, "um", 600 ms, the clip again; and the clips as recorded, whose own pauses count
too) through a local mesh with the option on and off, interleaved, and reports per mode:

  cut             utterances the gateway committed more than one turn in;
  answered_whole  of those, how many had their last reply answer a user line that starts with all the words of
                  the first turn and goes on (the continued turn), not only the words after the pause;
  continued       Interrupted events with `continued`;
  heard_ms        reply audio the client received for a cut turn before the user's speech stopped it;
  last_v2v_ms     V2V of the last turn (the reply to the whole, where it was continued).

`python -m bench.continuation`, JSON on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from bench import print_result
from bench.turns import CLIPS, build_set
from gateway.turn import words_of
from voicemesh.audio import Clip
from voicemesh.conversation import Interrupted, ReplyAudio, talk
from voicemesh.mesh import local_mesh
from voicemesh.v1 import conversation_pb2

DEFAULT_CLIPS = ("spk1_snt1", "spk2_snt1", "wizard", "horizon", "jfk")
KINDS = ("complete", "spliced", "hesitation")
MODES = {
    "continue_on": conversation_pb2.PipelineOptions(continue_unheard_turns=True),
    "continue_off": conversation_pb2.PipelineOptions(continue_unheard_turns=False),
}


async def _one(target: str, name: str, clip: Clip, options: conversation_pb2.PipelineOptions) -> dict[str, object]:
    config = conversation_pb2.SessionConfig(
        input_sample_rate_hz=clip.rate_hz, output_sample_rate_hz=16000, options=options
    )
    turns, _, events = await talk(target, clip, config, trailing_silence_s=3.0)
    said = [t for t in turns if t.user_text]
    stops = [e for e in events if isinstance(e, Interrupted)]
    heard_ms = []
    for stop in stops:
        samples = 0
        for event in events:
            if event is stop:
                break
            if isinstance(event, ReplyAudio) and event.turn_index == stop.turn_index:
                samples += len(event.pcm16) // 2
        heard_ms.append(round(samples / 16, 1))
    first, last = (words_of(said[0].user_text), words_of(said[-1].user_text)) if said else ([], [])
    return {
        "utterance": name,
        "user_turns": [t.user_text for t in said],
        "cut": len(said) > 1,
        # The last line carries the first turn's words and more: the turn was continued (or never cut).
        "answered_whole": len(said) == 1 or (last[: len(first)] == first and len(last) > len(first)),
        "continued": sum(stop.continued for stop in stops),
        "interrupted": len(stops),
        "heard_ms": heard_ms,
        "last_v2v_ms": None if not said or said[-1].v2v_ms is None else round(said[-1].v2v_ms, 1),
    }


def _summary(rows: list[dict[str, object]]) -> dict[str, object]:
    cut = [r for r in rows if r["cut"]]
    heard = [ms for r in cut for ms in r["heard_ms"]]  # type: ignore[attr-defined]
    v2v = [r["last_v2v_ms"] for r in rows if r["last_v2v_ms"] is not None]
    return {
        "utterances": len(rows),
        "cut": len(cut),
        "answered_whole": sum(bool(r["answered_whole"]) for r in cut),
        "continued": sum(int(r["continued"]) for r in rows),  # type: ignore[call-overload]
        "heard_ms_p50": statistics.median(heard) if heard else None,
        "heard_ms_max": max(heard) if heard else None,
        "last_v2v_p50_ms": round(statistics.median(v2v), 1) if v2v else None,  # type: ignore[type-var]
    }


async def measure(target: str, utterances: list[tuple[str, Clip]]) -> dict[str, object]:
    rows: dict[str, list[dict[str, object]]] = {mode: [] for mode in MODES}
    for name, clip in utterances:
        for mode, options in MODES.items():  # interleaved: drift in load hits both alike
            rows[mode].append(await _one(target, name, clip, options))
    return {
        **{mode: _summary(mode_rows) for mode, mode_rows in rows.items()},
        "per_utterance": rows,
    }


def run(clips: list[str]) -> dict[str, object]:
    from services.asr.whisper_engine import WhisperTranscriber

    names = [c for c in clips if (CLIPS / f"{c}.wav").exists()]
    if not names:
        return {"skipped": f"no clips under {CLIPS}"}
    transcriber = WhisperTranscriber(cpu_threads=2)  # word times for the splices; gone before the mesh starts
    utterances = [(u.name, Clip(u.audio, u.rate_hz)) for u in build_set(transcriber, names) if u.kind in KINDS]
    del transcriber
    with local_mesh("voicemesh-bench-") as gateway:
        return asyncio.run(measure(gateway, utterances))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", default=",".join(DEFAULT_CLIPS))
    parser.add_argument("--per-utterance", action="store_true", help="include every utterance in the output")
    args = parser.parse_args()
    result = run(args.clips.split(","))
    print_result(result, drop=None if args.per_utterance else "per_utterance")


if __name__ == "__main__":
    main()
