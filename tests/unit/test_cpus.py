"""One CPU budget for the box: each engine's threads derived from the mesh's cores, the operator's own settings
left alone, and a local mesh's services started with them."""

from __future__ import annotations

import subprocess

import pytest

from voicemesh.cpus import budget_env, thread_split
from voicemesh.mesh import Mesh


@pytest.mark.parametrize("cpus", [1, 2, 3, 4, 8, 64])
def test_no_engine_asks_for_more_cores_than_the_mesh_has(cpus: int) -> None:
    split = thread_split(cpus)
    assert all(1 <= threads <= cpus for threads in split.values()), split
    assert split["VOICEMESH_LLM_N_THREADS_BATCH"] == cpus, "the prefill (time to first token) gets every core"
    # The decode and the TTS run beside another session's urgent work: together they take at most the cores.
    assert split["VOICEMESH_LLM_N_THREADS"] + split["VOICEMESH_TTS_INTRA_OP_THREADS"] <= max(2, cpus)
    assert split["VOICEMESH_ASR_CPU_THREADS"] == 1


def test_two_cores_get_the_split_measured_best_there() -> None:
    assert thread_split(2) == {
        "VOICEMESH_ASR_WORKERS": 2,
        "VOICEMESH_ASR_CPU_THREADS": 1,
        "VOICEMESH_LLM_N_THREADS_BATCH": 2,
        "VOICEMESH_LLM_N_THREADS": 1,
        "VOICEMESH_TTS_INTRA_OP_THREADS": 1,
    }


def test_a_budget_of_no_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one core"):
        thread_split(0)


def test_the_operators_own_setting_wins_over_the_budget() -> None:
    env = budget_env(4, {"VOICEMESH_LLM_N_THREADS": "3"})
    assert "VOICEMESH_LLM_N_THREADS" not in env["llm"]
    assert env["llm"]["VOICEMESH_LLM_N_THREADS_BATCH"] == "4"
    assert env["tts"] == {"VOICEMESH_TTS_INTRA_OP_THREADS": "2"}
    assert env["asr"] == {"VOICEMESH_ASR_WORKERS": "4", "VOICEMESH_ASR_CPU_THREADS": "1"}


def test_a_local_mesh_starts_each_service_with_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in thread_split(1):
        monkeypatch.delenv(variable, raising=False)
    started: dict[str, dict[str, str]] = {}

    def spawn(self: Mesh, name: str, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen[bytes]:
        started[name] = env or {}
        return subprocess.Popen(["true"])

    monkeypatch.setattr(Mesh, "_spawn", spawn)
    mesh = Mesh()
    mesh.start_local({"asr": 1, "llm": 2, "tts": 3, "gateway": 4}, http_port=-1, cpus=2)
    assert started["llm"] == {"VOICEMESH_LLM_N_THREADS_BATCH": "2", "VOICEMESH_LLM_N_THREADS": "1"}
    assert started["tts"] == {"VOICEMESH_TTS_INTRA_OP_THREADS": "1"}
    assert started["asr"] == {"VOICEMESH_ASR_WORKERS": "2", "VOICEMESH_ASR_CPU_THREADS": "1"}
    assert started["gateway"] == {}
