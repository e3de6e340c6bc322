"""The phone door against the gRPC door, and telephone-band speech against wideband; `python -m bench.phone`.

One local mesh with its Twilio door open. V2V: the same clips spoken over gRPC (Conversation.Converse, 16 kHz) and
over the phone door (`voicemesh loadtest --transport twilio`'s test carrier: 8 kHz μ-law, marks echoed as played),
alternating door by round, one session at a time; V2V per turn = first reply audio received - send of the clip's
last speech frame (the load test's own measure: before the gateway's end of speech on gRPC, before the first reply
audio on the phone, which tells the caller nothing else), and, one measure for both, from the clip's last frame. WER: each clip transcribed by the ASR service wideband (16 kHz) and
as a phone carries it (8 kHz through G.711 μ-law and A-law), against its reference transcript.

Prints JSON: per door V2V p50/p95 and turns, the phone's p50 less gRPC's against the +60 ms target; WER per clip and
in total per band.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from typing import Any

from bench import clips_main, door_gap
from harness.clips import SHARED_AUDIO, TRANSCRIPTS, clip_path, load_clip
from voicemesh import g711
from voicemesh.audio import Clip
from voicemesh.clients import recognize
from voicemesh.evaluation import word_error_rate
from voicemesh.loadtest import LoadTestOptions, loadtest
from voicemesh.mesh import DEFAULT_PORTS, Mesh, free_port

TARGET_GAP_MS = 60.0
CLIPS = ("spk1_snt1", "spk2_snt1", "horizon", "jfk", "wizard")


async def transcript(asr: str, clip: Clip) -> str:
    finals = [
        event.final.text
        async for _, event in recognize(asr, clip, rate_hz=clip.rate_hz, realtime=False)
        if event.WhichOneof("event") == "final"
    ]
    return " ".join(finals)


async def word_error_rates(asr: str, names: Sequence[str]) -> dict[str, Any]:
    bands: dict[str, dict[str, float]] = {"wideband_16k": {}, "g711_ulaw_8k": {}, "g711_alaw_8k": {}}
    heard: dict[str, dict[str, str]] = {band: {} for band in bands}
    for name in names:
        clip = load_clip(name).to_rate(16000)
        for band, audio in (
            ("wideband_16k", clip),
            ("g711_ulaw_8k", g711.telephone_band(clip, "PCMU")),
            ("g711_alaw_8k", g711.telephone_band(clip, "PCMA")),
        ):
            text = await transcript(asr, audio)
            heard[band][name] = text
            bands[band][name] = round(word_error_rate(TRANSCRIPTS[name], text), 3)
    total = {
        band: round(
            sum(rates[name] * len(TRANSCRIPTS[name].split()) for name in names)
            / sum(len(TRANSCRIPTS[name].split()) for name in names),
            3,
        )
        for band, rates in bands.items()
    }
    return {"per_clip": bands, "total": total, "heard": heard}


async def door_v2v(grpc_target: str, http_target: str, token: str, names: Sequence[str], rounds: int) -> dict[str, Any]:
    audio = tuple(str(clip_path(name)) for name in names)
    v2v: dict[str, list[float]] = {"grpc": [], "twilio": []}
    # One measure for both doors: from the send of the clip's last frame (the clips end where their speech does).
    from_clip_end: dict[str, list[float]] = {"grpc": [], "twilio": []}
    failed: dict[str, list[str]] = {"grpc": [], "twilio": []}
    for round_index in range(rounds):
        doors = ("grpc", "twilio") if round_index % 2 == 0 else ("twilio", "grpc")
        for door in doors:
            options = LoadTestOptions(
                target=grpc_target if door == "grpc" else http_target,
                transport=door,
                sessions=1,
                turns=len(names),
                audio=audio,
                pause_s=(1.0, 1.0),
                twilio_auth_token=token,
            )
            report = await loadtest(options)
            for row in report.per_turn:
                if row.ok and row.v2v_ms is not None:
                    v2v[door].append(row.v2v_ms)
                    if row.first_audio_s is not None and row.clip_end_s is not None:
                        from_clip_end[door].append(round((row.first_audio_s - row.clip_end_s) * 1000, 1))
                else:
                    failed[door].append(f"{row.clip}: {row.status} {row.detail}"[:160])
    return {
        **door_gap(v2v, from_clip_end, "twilio", "phone", TARGET_GAP_MS),
        "failed": failed,
        "per_turn_ms": v2v,
    }


async def run(rounds: int, names: Sequence[str]) -> dict[str, Any]:
    token = "bench-phone-" + str(time.time_ns())
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix="voicemesh-bench-phone-"))
    ports = {name: free_port() for name in DEFAULT_PORTS}
    http_port = free_port()
    mesh.start_local(ports, http_port=http_port, gateway_args=[f"--twilio-auth-token={token}"])
    try:
        await mesh.wait(timeout_s=240)
        asr = f"127.0.0.1:{ports['asr']}"
        wer = await word_error_rates(asr, names)
        doors = await door_v2v(f"127.0.0.1:{ports['gateway']}", f"127.0.0.1:{http_port}", token, names, rounds)
    finally:
        mesh.stop_all()
    return {"clips": list(names), "speech": str(SHARED_AUDIO), "rounds": rounds, **doors, "wer": wer}


def main(argv: Sequence[str] | None = None) -> None:
    clips_main("python -m bench.phone", __doc__ or "", CLIPS, run, argv)


if __name__ == "__main__":
    main()
