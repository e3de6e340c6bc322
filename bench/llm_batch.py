"""Does llama.cpp's multi-sequence batched decoding pay on this machine? Aggregate decode tokens/s of the embedded
Gemma 3 270M with 1, 2 and 4 sequences in one KV cache, one decode call per step (each sequence's next token in
the same batch), side by side in one run. The question behind it (issue 13): would one replica that decodes
several conversations at once, with one copy of the model, hold more sessions than one that takes turns?

Greedy decoding on real prompts (the persona, the examples and a user line), after a prefill that is not timed.
Then the same question of the engines as shipped: N replies at once through the batched engine (`max_batch` 8)
and through the slot engine (one reply at a time, `max_batch` 1), with every cost in (prefill, sampling, stop
strings, the asyncio hand-off), as aggregate completion tokens/s and the replies' first-token times.
`python -m bench.llm_batch`.

`--prefill`: a reply's time to first token, the turn-end score included, with and without a prefill of the user's
words but the last two beforehand (what the gateway sends from the partial transcripts while the user speaks), side
by side per sentence, through both engines, on the 40 sentences of bench/turn_sentences.py.

`--calling-threads`: one decode step (one sequence) when every llama.cpp call comes from one thread, against when a
warm-up ran on another thread first (what the engines did before: a team of OpenMP threads is left per calling
thread, and past one thread per core libgomp sleeps between parallel regions instead of spinning). Each case runs in
a fresh process, rounds interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama

from services.llm.engine import GenerationRequest, Message
from services.llm.llama_batch_engine import LlamaBatchEngine
from services.llm.llama_common import default_model_path
from services.llm.llama_cpp_engine import LlamaCppEngine
from services.llm.prompt import CompletionPrompt

QUESTIONS = (
    "What is the capital of France?",
    "Can you tell me what the weather will be like tomorrow?",
    "How long does it take to boil an egg?",
    "Could you explain how compound interest works?",
)


def _context(llama: Llama, sequences: int, threads: int) -> llama_cpp.llama_context_p:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = 512 * sequences
    params.n_batch = 512
    params.n_ubatch = 512
    params.n_seq_max = sequences
    params.n_threads = threads
    params.n_threads_batch = threads
    params.kv_unified = True
    context = llama_cpp.llama_init_from_model(llama._model.model, params)
    if not context:
        raise RuntimeError("llama.cpp could not create the context")
    return context


def _decode(context: llama_cpp.llama_context_p, batch: llama_cpp.llama_batch, rows: list[tuple[int, int, int]]) -> None:
    """Decode `rows` of (token, position, sequence id), logits for each."""
    batch.n_tokens = len(rows)
    for index, (token, position, sequence) in enumerate(rows):
        batch.token[index] = token
        batch.pos[index] = position
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = sequence
        batch.logits[index] = True
    if llama_cpp.llama_decode(context, batch) != 0:
        raise RuntimeError("llama_decode failed")


def measure(llama: Llama, streams: int, steps: int, threads: int) -> dict[str, object]:
    prompt = CompletionPrompt()
    context = _context(llama, streams, threads)
    batch = llama_cpp.llama_batch_init(512, 0, streams)
    vocab = llama.n_vocab()
    try:
        positions, last = [], []
        for sequence in range(streams):  # prefill each prompt in its own sequence (not timed)
            text = prompt.render([Message("user", QUESTIONS[sequence % len(QUESTIONS)])])
            tokens = llama.tokenize(text.encode(), add_bos=True)
            _decode(context, batch, [(token, index, sequence) for index, token in enumerate(tokens)])
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context, len(tokens) - 1), shape=(vocab,))
            last.append(int(np.argmax(logits)))
            positions.append(len(tokens))
        step_ms = []
        for _ in range(steps):
            rows = [(last[s], positions[s], s) for s in range(streams)]
            started = time.perf_counter()
            _decode(context, batch, rows)
            for s in range(streams):
                row = llama_cpp.llama_get_logits_ith(context, s)
                last[s] = int(np.argmax(np.ctypeslib.as_array(row, shape=(vocab,))))
                positions[s] += 1
            step_ms.append((time.perf_counter() - started) * 1000)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(context)
    median = statistics.median(step_ms)
    return {
        "streams": streams,
        "step_ms_p50": round(median, 2),
        "aggregate_tokens_per_s": round(streams * 1000 / median, 1),
        "per_stream_tokens_per_s": round(1000 / median, 1),
    }


def run(steps: int = 48, threads: int = 2, levels: tuple[int, ...] = (1, 2, 4)) -> dict[str, object]:
    llama = Llama(model_path=str(default_model_path()), n_ctx=512, n_threads=threads, verbose=False)
    vocabulary = llama.n_vocab()
    try:
        measure(llama, 1, 8, threads)  # warm-up: compute buffers, page cache
        results = [measure(llama, streams, steps, threads) for streams in levels]
    finally:
        llama.close()
    one = results[0]["aggregate_tokens_per_s"]
    assert isinstance(one, float)
    for result in results:
        rate = result["aggregate_tokens_per_s"]
        assert isinstance(rate, float)
        result["aggregate_vs_1_stream"] = round(rate / one, 2)
    return {
        "model": default_model_path().name,
        "threads": threads,
        "steps": steps,
        "vocabulary": vocabulary,
        "levels": results,
    }


async def _replies(engine: LlamaBatchEngine | LlamaCppEngine, streams: int, round_: int) -> dict[str, float]:
    """`streams` replies at once, each continuing the alphabet (~45 tokens), new sessions every round."""

    async def one(index: int) -> tuple[int, float]:
        request = GenerationRequest(
            f"bench-{round_}-{index}",
            [Message("user", f"{QUESTIONS[index % len(QUESTIONS)]} Then say the alphabet.")],
            max_tokens=48,
            reply_prefix="A, B, C, D,",
        )
        started, first = time.perf_counter(), 0.0
        async for chunk in engine.generate(request):
            if chunk.text and not first:
                first = time.perf_counter() - started
            if chunk.finish_reason:
                return chunk.completion_tokens, first
        return 0, first

    started = time.perf_counter()
    results = await asyncio.gather(*(one(index) for index in range(streams)))
    wall = time.perf_counter() - started
    return {
        "tokens": sum(tokens for tokens, _ in results),
        "wall_s": wall,
        "first_token_ms_p50": 1000 * statistics.median(first for _, first in results),
    }


async def compare_engines(levels: tuple[int, ...], rounds: int, threads: int) -> dict[str, object]:
    """Aggregate tokens/s and first-token times of both engines at each level, rounds interleaved."""
    engines: dict[str, LlamaBatchEngine | LlamaCppEngine] = {
        "batch": LlamaBatchEngine(default_model_path(), n_threads=threads, n_threads_batch=threads, max_batch=8),
        "slots": LlamaCppEngine(default_model_path(), n_threads=threads, n_threads_batch=threads),
    }
    for engine in engines.values():
        await engine.start()
        await _replies(engine, 2, -1)  # warm-up
    runs: dict[str, dict[int, list[dict[str, float]]]] = {name: {n: [] for n in levels} for name in engines}
    try:
        for round_ in range(rounds):
            for streams in levels:
                for name, engine in engines.items():
                    runs[name][streams].append(await _replies(engine, streams, round_))
    finally:
        for engine in engines.values():
            await engine.close()
    table: dict[str, object] = {}
    for streams in levels:
        row: dict[str, object] = {}
        for name in engines:
            done = runs[name][streams]
            row[name] = {
                "aggregate_tokens_per_s": round(sum(r["tokens"] for r in done) / sum(r["wall_s"] for r in done), 1),
                "first_token_ms_p50": round(statistics.median(r["first_token_ms_p50"] for r in done), 1),
            }
        batch, slots = row["batch"], row["slots"]
        assert isinstance(batch, dict) and isinstance(slots, dict)
        row["batch_over_slots_tokens_per_s"] = round(
            batch["aggregate_tokens_per_s"] / slots["aggregate_tokens_per_s"], 2
        )
        table[str(streams)] = row
    return {"rounds": rounds, "max_tokens": 48, "levels": table}


CALLING_THREAD_CASES = ("one_thread", "warmed_up_on_another_thread")


def calling_thread_probe(case: str, steps: int, threads: int) -> float:
    """The p50 decode step (ms) in this process, with every call on one thread or a warm-up on another first."""
    llama = Llama(model_path=str(default_model_path()), n_ctx=16, n_batch=16, n_threads=1, verbose=False)
    result: list[float] = []

    def decode() -> None:
        if case == "one_thread":
            measure(llama, 1, 8, threads)  # warm-up
        step = measure(llama, 1, steps, threads)["step_ms_p50"]
        assert isinstance(step, float)
        result.append(step)

    if case == "warmed_up_on_another_thread":
        measure(llama, 1, 8, threads)
    worker = threading.Thread(target=decode)
    worker.start()
    worker.join()
    llama.close()
    return result[0]


async def compare_prefill(rounds: int, threads: int) -> dict[str, object]:
    from bench.turn_sentences import CHECK, TUNE

    result: dict[str, object] = {"rounds": rounds, "sentences": len(TUNE) + len(CHECK), "held_back_words": 2}
    for name, engine in (
        ("batched", LlamaBatchEngine(default_model_path(), n_threads=threads, n_threads_batch=threads)),
        ("slot", LlamaCppEngine(default_model_path(), n_threads=threads, n_threads_batch=threads)),
    ):
        await engine.start()
        ttft: dict[str, list[float]] = {"without": [], "with": []}
        evaluated: list[int] = []
        try:
            for round_ in range(rounds):
                for index, sentence in enumerate((*TUNE, *CHECK)):
                    for case in ("without", "with") if (round_ + index) % 2 else ("with", "without"):
                        session = f"{name}-{case}-{round_}-{index}"  # a new session: the head cached, nothing else
                        # The slot engine's one cache holds the last prompt, this sentence's own: replaced first
                        # (once the last reply's thread has handed the slot back; a prefill never waits for it).
                        await asyncio.sleep(0.01)
                        await engine.prefill("elsewhere", [Message("user", f"Something else entirely, {index}.")])
                        if case == "with":
                            words = sentence.split()[:-2]
                            done = await engine.prefill(session, [Message("user", " ".join(words))])
                            evaluated.append(done.evaluated_tokens)
                        request = GenerationRequest(
                            session, [Message("user", sentence)], max_tokens=2, score_turn_end=True
                        )
                        chunks = [chunk async for chunk in engine.generate(request)]
                        ttft[case].append(next(c.ttft_ms for c in chunks if c.ttft_ms))
        finally:
            await engine.close()
        medians = {case: round(statistics.median(values), 1) for case, values in ttft.items()}
        result[name] = {
            "ttft_ms_p50": medians,
            "ttft_ms_mean": {case: round(statistics.mean(values), 1) for case, values in ttft.items()},
            "with_over_without": round(medians["with"] / medians["without"], 2),
            "prefilled_tokens_p50": statistics.median(evaluated),
        }
    return result


def compare_calling_threads(rounds: int, steps: int, threads: int) -> dict[str, object]:
    runs: dict[str, list[float]] = {case: [] for case in CALLING_THREAD_CASES}
    for _ in range(rounds):
        for case in CALLING_THREAD_CASES:
            argv = [sys.executable, "-m", "bench.llm_batch", "--probe", case, "--steps", str(steps)]
            output = subprocess.run([*argv, "--threads", str(threads)], check=True, capture_output=True, text=True)
            runs[case].append(float(output.stdout.strip().splitlines()[-1]))
    medians = {case: round(statistics.median(values), 2) for case, values in runs.items()}
    return {
        "threads": threads,
        "steps": steps,
        "rounds": rounds,
        "step_ms_p50": medians,
        "step_ms_each_round": runs,
        "warmed_elsewhere_over_one_thread": round(
            medians[CALLING_THREAD_CASES[1]] / medians[CALLING_THREAD_CASES[0]], 2
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the engine comparison")
    parser.add_argument("--calling-threads", action="store_true", help="only the calling-thread comparison")
    parser.add_argument("--prefill", action="store_true", help="only the prefill comparison")
    parser.add_argument("--probe", choices=CALLING_THREAD_CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(calling_thread_probe(args.probe, args.steps, args.threads))
        return
    if args.prefill:
        json.dump(asyncio.run(compare_prefill(args.rounds, args.threads)), sys.stdout, indent=2)
        print()
        return
    if args.calling_threads:
        json.dump(compare_calling_threads(args.rounds, args.steps, args.threads), sys.stdout, indent=2)
        print()
        return
    result = run(args.steps, args.threads, levels=(1, 2, 4, 8))
    result["engines"] = asyncio.run(compare_engines((1, 2, 4, 8), args.rounds, args.threads))
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
