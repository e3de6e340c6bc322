"""One CPU budget for the box: each engine's threads derived from the mesh's cores, the operator's own settings
left alone, and a local mesh's services started with them; background work on threads of a higher nice value."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from voicemesh.cpus import FIRST_CHUNK_YIELD_MS, background, budget_env, lower_this_thread, thread_nice, thread_split
from voicemesh.mesh import Mesh
from voicemesh.workers import WorkerPool


@pytest.mark.parametrize("cpus", [1, 2, 3, 4, 8, 64])
def test_no_engine_asks_for_more_cores_than_the_mesh_has(cpus: int) -> None:
    split = thread_split(cpus)
    assert split.pop("VOICEMESH_LLM_FIRST_CHUNK_YIELD_MS") == FIRST_CHUNK_YIELD_MS, "a pause, not a thread count"
    assert all(1 <= threads <= cpus for threads in split.values()), split
    assert split["VOICEMESH_LLM_N_THREADS_BATCH"] == cpus, "the prefill (time to first token) gets every core"
    # The decode and the TTS run beside another session's urgent work: together they take at most the cores.
    assert split["VOICEMESH_LLM_N_THREADS"] + split["VOICEMESH_TTS_INTRA_OP_THREADS"] <= max(2, cpus)
    assert split["VOICEMESH_ASR_CPU_THREADS"] == 1
    assert split["VOICEMESH_TTS_FIRST_CHUNK_THREADS"] == cpus, "a reply's first chunk (urgent) gets every core"


def test_two_cores_get_the_split_measured_best_there() -> None:
    assert thread_split(2) == {
        "VOICEMESH_ASR_WORKERS": 2,
        "VOICEMESH_ASR_CPU_THREADS": 1,
        "VOICEMESH_LLM_N_THREADS_BATCH": 2,
        "VOICEMESH_LLM_N_THREADS": 1,
        "VOICEMESH_LLM_FIRST_CHUNK_YIELD_MS": 50,
        "VOICEMESH_TTS_INTRA_OP_THREADS": 1,
        "VOICEMESH_TTS_FIRST_CHUNK_THREADS": 2,
    }


def test_a_budget_of_no_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one core"):
        thread_split(0)


def test_the_operators_own_setting_wins_over_the_budget() -> None:
    env = budget_env(4, {"VOICEMESH_LLM_N_THREADS": "3"})
    assert "VOICEMESH_LLM_N_THREADS" not in env["llm"]
    assert env["llm"]["VOICEMESH_LLM_N_THREADS_BATCH"] == "4"
    assert env["tts"] == {"VOICEMESH_TTS_INTRA_OP_THREADS": "2", "VOICEMESH_TTS_FIRST_CHUNK_THREADS": "4"}
    assert env["asr"] == {"VOICEMESH_ASR_WORKERS": "4", "VOICEMESH_ASR_CPU_THREADS": "1"}


def _local_mesh_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, str]]:
    """The variables `start_local` gives each process (by name) beside the environment, its processes `true`."""
    started: dict[str, dict[str, str]] = {}

    def spawn(self: Mesh, name: str, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen[bytes]:
        started[name] = env or {}
        return subprocess.Popen(["true"])

    monkeypatch.setattr(Mesh, "_spawn", spawn)
    Mesh().start_local({"asr": 1, "llm": 2, "tts": 3, "gateway": 4}, http_port=-1, cpus=2)
    return started


def test_a_local_mesh_starts_each_service_with_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in thread_split(1):
        monkeypatch.delenv(variable, raising=False)
    started = _local_mesh_env(monkeypatch)
    assert started["llm"] == {
        "VOICEMESH_LLM_N_THREADS_BATCH": "2",
        "VOICEMESH_LLM_N_THREADS": "1",
        "VOICEMESH_LLM_FIRST_CHUNK_YIELD_MS": "50",
    }
    assert started["tts"] == {"VOICEMESH_TTS_INTRA_OP_THREADS": "1", "VOICEMESH_TTS_FIRST_CHUNK_THREADS": "2"}
    assert started["asr"] == {"VOICEMESH_ASR_WORKERS": "2", "VOICEMESH_ASR_CPU_THREADS": "1"}
    assert started["gateway"] == {}


def test_a_local_meshs_asr_fuses_by_the_fit_on_the_scorer_the_llm_is_set_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VOICEMESH_ASR_TURN_FUSION", raising=False)
    monkeypatch.setenv("VOICEMESH_LLM_TURN_END_SCORER", "probe")
    assert _local_mesh_env(monkeypatch)["asr"]["VOICEMESH_ASR_TURN_FUSION"] == "probe"
    monkeypatch.setenv("VOICEMESH_ASR_TURN_FUSION", "line_end")  # the operator's own choice stays
    assert "VOICEMESH_ASR_TURN_FUSION" not in _local_mesh_env(monkeypatch)["asr"]
    monkeypatch.delenv("VOICEMESH_ASR_TURN_FUSION")
    monkeypatch.delenv("VOICEMESH_LLM_TURN_END_SCORER")
    assert "VOICEMESH_ASR_TURN_FUSION" not in _local_mesh_env(monkeypatch)["asr"], "the ASR's own default"


def _nice_of_this_thread() -> int:
    return thread_nice(threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread only on Linux")
def test_an_engine_built_in_the_background_runs_its_own_threads_at_that_nice_value() -> None:
    def build() -> tuple[int, int]:
        seen: list[int] = []
        worker = threading.Thread(target=lambda: seen.append(_nice_of_this_thread()))  # as an engine's pool would
        worker.start()
        worker.join()
        return _nice_of_this_thread(), seen[0]

    assert background(7, build) == (7, 7)
    assert _nice_of_this_thread() == 0, "the caller's own thread keeps its priority"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread only on Linux")
async def test_a_worker_pool_for_background_work_runs_its_jobs_at_its_nice_value() -> None:
    background_pool, urgent_pool = WorkerPool(1, "test-background", nice=9), WorkerPool(1, "test-urgent")
    assert (await background_pool.run(_nice_of_this_thread)).result == 9
    assert (await urgent_pool.run(_nice_of_this_thread)).result == 0


def test_a_nice_value_out_of_range_is_refused_and_a_failed_build_raises_in_the_caller() -> None:
    with pytest.raises(ValueError, match="0-19"):
        WorkerPool(1, "test", nice=20)
    with pytest.raises(ValueError, match="0-19"):
        lower_this_thread(-1)

    def broken() -> None:
        raise RuntimeError("model file missing")

    with pytest.raises(RuntimeError, match="model file missing"):
        background(3, broken)
