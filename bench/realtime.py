"""The OpenAI Realtime door against the gRPC door on the same clips; `python -m bench.realtime`.

One local mesh, its HTTP door open. The same clips spoken over gRPC (Conversation.Converse) and over /v1/realtime
(`voicemesh loadtest --transport realtime`: 24 kHz audio/pcm appends, semantic_vad, the door's defaults), alternating
door by round, one session at a time. V2V per turn = first reply audio received - send of the user's last speech
frame (the load test's measure; on the Realtime door the end of speech is where input_audio_buffer.speech_stopped
put it), and, one measure for both, from the clip's last frame. A reply runs dry when its audio came later than a
listener playing it from its first audio needed it.

Prints JSON: per door V2V p50/p95, the Realtime door's p50 less gRPC's against the +30 ms target, and the replies
that ran dry per door.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

from bench import clips_main, door_gap
from harness.clips import SHARED_AUDIO, clip_path
from voicemesh.loadtest import LoadTestOptions, loadtest
from voicemesh.mesh import DEFAULT_PORTS, Mesh, free_port

TARGET_GAP_MS = 30.0
CLIPS = ("spk1_snt1", "spk2_snt1", "horizon", "jfk", "wizard")
DOORS = ("grpc", "realtime")


async def compare(targets: dict[str, str], names: Sequence[str], rounds: int) -> dict[str, Any]:
    audio = tuple(str(clip_path(name)) for name in names)
    v2v: dict[str, list[float]] = {door: [] for door in DOORS}
    from_clip_end: dict[str, list[float]] = {door: [] for door in DOORS}
    ran_dry: dict[str, int] = dict.fromkeys(DOORS, 0)
    failed: dict[str, list[str]] = {door: [] for door in DOORS}
    for round_index in range(rounds):
        for door in DOORS if round_index % 2 == 0 else DOORS[::-1]:
            options = LoadTestOptions(
                target=targets[door], transport=door, sessions=1, turns=len(names), audio=audio, pause_s=(1.0, 1.0)
            )
            report = await loadtest(options)
            ran_dry[door] += report.replies_with_gap
            for row in report.per_turn:
                if not (row.ok and row.v2v_ms is not None):
                    failed[door].append(f"{row.clip}: {row.status} {row.detail}"[:160])
                    continue
                v2v[door].append(row.v2v_ms)
                if row.first_audio_s is not None and row.clip_end_s is not None:
                    from_clip_end[door].append(round((row.first_audio_s - row.clip_end_s) * 1000, 1))
    return {
        **door_gap(v2v, from_clip_end, "realtime", "realtime", TARGET_GAP_MS),
        "replies_ran_dry": ran_dry,
        "failed": failed,
        "per_turn_ms": v2v,
    }


async def run(rounds: int, names: Sequence[str]) -> dict[str, Any]:
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix="voicemesh-bench-realtime-"))
    ports = {name: free_port() for name in DEFAULT_PORTS}
    http_port = free_port()
    mesh.start_local(ports, http_port=http_port)
    try:
        await mesh.wait(timeout_s=240)
        targets = {"grpc": f"127.0.0.1:{ports['gateway']}", "realtime": f"127.0.0.1:{http_port}"}
        doors = await compare(targets, names, rounds)
    finally:
        mesh.stop_all()
    return {"clips": list(names), "speech": str(SHARED_AUDIO), "rounds": rounds, **doors}


def main(argv: Sequence[str] | None = None) -> None:
    clips_main("python -m bench.realtime", __doc__ or "", CLIPS, run, argv)


if __name__ == "__main__":
    main()
