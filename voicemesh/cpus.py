"""One CPU budget for a box that runs the whole mesh: every engine's threads derived from how many cores it has.

A turn's urgent work passes the stages one after another (the ASR's final decode, the LLM's prefill and first
words, the TTS's first chunk); what overlaps is one session's urgent work with the others' continuations (the LLM
decoding on, the TTS synthesizing later chunks). So the split gives:
- the ASR one thread per decode and a decode worker per core (up to 4): tiny.en's greedy decode is step-bound, a
  second thread does not speed it, and coinciding finals each get a core;
- the LLM every core for the prefill (time to first token, urgent) and half of them for the decode, which only has
  to stay ahead of playout;
- the TTS half the cores per synthesis, so a later chunk does not fight a decode on all of them; and every core
  for a reply's first chunk, which its listener waits for, while the LLM's decode of that reply steps aside
  (FIRST_CHUNK_YIELD_MS); each of the two alone is slower.

The measurements behind this split are in docs/decisions/0014 and 0015.

An explicit setting (a `VOICEMESH_*` variable, or a flag of `voicemesh serve`) wins over the budget.

Threads sharing the cores can also be told apart by urgency: work nobody waits on (the ASR's partial transcripts)
runs on threads with a higher nice value, so the kernel gives it only what the urgent work of every process leaves
idle (`background`). On Linux the nice value is per thread, and a thread inherits its creator's: an engine built
in such a thread runs all its own threads at that value too.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

NICE = range(0, 20)
"""Nice values a background thread may take (0: same priority as the rest)."""

MAX_ASR_WORKERS = 4
FIRST_CHUNK_YIELD_MS = 50
"""How long the LLM's decode of a reply pauses once its first words are out, for the TTS to synthesize them on
every core: about as long as Piper takes for a 2-3 word first chunk on 2 cores of their own."""


def available_cpus() -> int:
    """Cores this process may run on (its affinity, as `taskset` or a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_split(cpus: int) -> dict[str, int]:
    """Each engine's threads for a mesh with `cpus` cores, by the `VOICEMESH_*` variable that sets them; and the
    LLM's pause for the TTS's first chunk (VOICEMESH_LLM_FIRST_CHUNK_YIELD_MS, ms), which only a shared box needs."""
    if cpus < 1:
        raise ValueError(f"cpus={cpus}: a mesh needs at least one core")
    half = max(1, cpus // 2)
    return {
        "VOICEMESH_ASR_WORKERS": min(cpus, MAX_ASR_WORKERS),
        "VOICEMESH_ASR_CPU_THREADS": 1,
        "VOICEMESH_LLM_N_THREADS_BATCH": cpus,
        "VOICEMESH_LLM_N_THREADS": half,
        "VOICEMESH_LLM_FIRST_CHUNK_YIELD_MS": FIRST_CHUNK_YIELD_MS,
        "VOICEMESH_TTS_INTRA_OP_THREADS": half,
        "VOICEMESH_TTS_FIRST_CHUNK_THREADS": cpus,
    }


def budget_env(cpus: int, environ: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """The variables each service of a local mesh gets, per service name; those already in `environ` (the
    operator's own) are left to it."""
    environ = dict(os.environ) if environ is None else environ
    per_service: dict[str, dict[str, str]] = {"asr": {}, "llm": {}, "tts": {}}
    for variable, value in thread_split(cpus).items():
        if variable not in environ:
            per_service[variable.split("_")[1].lower()][variable] = str(value)
    return per_service


def check_nice(nice: int, name: str = "nice") -> None:
    """Refuse a nice value a background thread may not take (`name`: the setting's, for the message)."""
    if nice not in NICE:
        raise ValueError(f"{name}={nice} out of range; use 0-19")


def lower_this_thread(nice: int) -> None:
    """Give the calling thread (and the threads it starts from now on) nice value `nice`, if that is lower
    priority than it has. Linux only, where nice is per thread; elsewhere it would renice the whole process, so it
    does nothing. Raising priority back would need CAP_SYS_NICE, so callers keep such threads for such work."""
    check_nice(nice)
    if sys.platform.startswith("linux") and nice > os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, nice)


def background(nice: int, build: Callable[[], T]) -> T:
    """`build()` run in a fresh thread at nice value `nice`: an engine it creates starts its worker threads
    there, so they inherit the value (CTranslate2's decode threads, for one)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            lower_this_thread(nice)
            result.append(build())
        except BaseException as error:  # handed back to the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name=f"nice{nice}-build")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def thread_nice(native_id: int) -> int:
    """The nice value of one thread of this process (Linux), as the kernel reports it."""
    with open(f"/proc/self/task/{native_id}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[16])
