"""GPU check of the vLLM engine: start `voicemesh serve llm --engine vllm`, load it at several concurrencies, write JSON.

Run on a GPU machine from the repository root, with a Python that has voicemesh and the CUDA vLLM installed
(`pip install -e '.[vllm]'` and the generated stubs, or the llm-vllm image):

    python deploy/gpu/vllm_check.py --model-dir /models/gemma-3-270m-hf --out vllm-check.json

Per concurrency level (1, 8, 32 by default) it reports time to first token as the client sees it (p50/p95, queue
included), the server's queue_ms and ttft_ms, and tokens per second: all replies' tokens over the level's wall
time, and per request after its first token; every other request also asks for the turn-end score, and the level
reports how many came before the reply, their score_ms, and the scored requests' ttft beside the others'. Every request
is bounded (max_tokens, a deadline), so it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the generated stubs are imported at run time only once the venv is known to have them
    from voicemesh.v1.llm_pb2_grpc import GeneratorAsyncStub

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # voicemesh from this checkout when it is not installed

PROMPTS = (
    "Tell me a story.",
    "What is the capital of France?",
    "Describe your favourite meal.",
    "How do I keep my phone battery alive longer?",
)


@dataclass
class Reply:
    """One request as the client saw it."""

    first_token_ms: float  # request sent -> first text delta (queue and prefill included)
    total_ms: float
    queue_ms: float  # server-reported: waiting for a batch slot
    ttft_ms: float  # server-reported: slot -> first token
    completion_tokens: int
    finish: str
    scored: bool = False  # asked for the turn-end score (every other request)
    turn_end: float | None = None  # the score, if it came before the first text delta
    score_ms: float | None = None  # server-reported: request -> score


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def start_service(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    argv = [args.python, "-m", "voicemesh.cli", "serve", "llm", "--port", str(port), "--engine", "vllm"]
    argv += ["--vllm-model-dir", str(args.model_dir), "--n-ctx", str(args.n_ctx)]
    argv += ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    argv += ["--max-queue-wait-ms", "0"]  # measure vLLM's queue, not the admission refusals
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=log_file, start_new_session=True)


def stop_service(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)  # vLLM's engine processes, should any outlive the service
    except ProcessLookupError:
        pass


async def wait_serving(process: subprocess.Popen[bytes], target: str, timeout_s: float) -> float:
    """Seconds until health SERVING; raises if the service exits or the time runs out."""
    from voicemesh.mesh import wait_healthy

    started = time.monotonic()
    task = asyncio.ensure_future(wait_healthy(target, timeout_s))
    while not task.done():
        if process.poll() is not None:
            task.cancel()
            raise RuntimeError(f"the service exited with {process.returncode} while starting; see its log")
        await asyncio.sleep(0.5)
    task.result()
    return time.monotonic() - started


async def one_request(stub: GeneratorAsyncStub, index: int, max_tokens: int, deadline_s: float) -> Reply:
    from voicemesh.v1 import llm_pb2

    request = llm_pb2.GenerateRequest(
        session_id=f"gpu-check-{index}",
        messages=[llm_pb2.ChatMessage(role=llm_pb2.ROLE_USER, content=PROMPTS[index % len(PROMPTS)])],
        max_tokens=max_tokens,
        temperature=1.0,  # sampled, so replies run longer than this base model's greedy one-liners
        top_p=1.0,
        seed=index + 1,
        # Every other request also asks for the turn-end score (a second one-token request beside the reply's, in
        # the same engine steps): its cost shows as the scored requests' ttft against the others'.
        score_turn_end=index % 2 == 1,
    )
    sent = time.monotonic()
    first_ms = queue_ms = ttft_ms = None
    tokens, finish = 0, "none"
    turn_end = score_ms = None
    async for response in stub.Generate(request, timeout=deadline_s):
        if not response.ByteSize():
            continue  # a keepalive: the replica is alive, the request still waits
        if response.HasField("turn_end"):
            if first_ms is None:
                turn_end, score_ms = response.turn_end.probability, response.turn_end.score_ms
            continue
        now_ms = (time.monotonic() - sent) * 1000
        if first_ms is None:
            queue_ms, ttft_ms = response.queue_ms, response.ttft_ms
        if first_ms is None and response.text_delta:
            first_ms = now_ms
        if response.finish_reason:
            tokens = response.usage.completion_tokens
            finish = llm_pb2.FinishReason.Name(response.finish_reason)
    total_ms = (time.monotonic() - sent) * 1000
    return Reply(
        first_ms or total_ms,
        total_ms,
        queue_ms or 0.0,
        ttft_ms or 0.0,
        tokens,
        finish,
        request.score_turn_end,
        turn_end,
        score_ms,
    )


async def run_level(target: str, concurrency: int, requests: int, max_tokens: int, deadline_s: float) -> dict:
    """`requests` requests from `concurrency` workers, each sending its next as soon as its last ended."""
    import grpc

    from voicemesh.v1 import llm_pb2_grpc

    counter = iter(range(requests))
    replies: list[Reply] = []
    errors: list[str] = []

    async def worker(stub: GeneratorAsyncStub) -> None:
        for index in counter:
            try:
                replies.append(await one_request(stub, index, max_tokens, deadline_s))
            except grpc.aio.AioRpcError as error:
                errors.append(f"{error.code().name}: {error.details()}")

    async with grpc.aio.insecure_channel(target) as channel:
        stub = llm_pb2_grpc.GeneratorStub(channel)
        started = time.monotonic()
        await asyncio.gather(*(worker(stub) for _ in range(concurrency)))
        wall_s = time.monotonic() - started

    def summary(values: list[float]) -> dict:
        return {"p50": _round(percentile(values, 50)), "p95": _round(percentile(values, 95))}

    decode_rates = [
        (r.completion_tokens - 1) / ((r.total_ms - r.first_token_ms) / 1000)
        for r in replies
        if r.completion_tokens > 1 and r.total_ms > r.first_token_ms
    ]
    total_tokens = sum(r.completion_tokens for r in replies)
    return {
        "concurrency": concurrency,
        "requests": len(replies),
        "errors": errors[:5],
        "error_count": len(errors),
        "wall_s": round(wall_s, 2),
        "ttft_ms": summary([r.first_token_ms for r in replies]),
        "server_queue_ms": summary([r.queue_ms for r in replies]),
        "server_ttft_ms": summary([r.ttft_ms for r in replies]),
        "total_ms": summary([r.total_ms for r in replies]),
        "completion_tokens": {"total": total_tokens, "mean": _round(total_tokens / max(1, len(replies)))},
        "tokens_per_s": _round(total_tokens / wall_s) if wall_s else None,
        "per_request_decode_tokens_per_s": summary(decode_rates),
        "finish_reasons": {name: sum(r.finish == name for r in replies) for name in {r.finish for r in replies}},
        "turn_end": {
            "asked": sum(r.scored for r in replies),
            "scored_before_the_reply": sum(r.turn_end is not None for r in replies),
            "score_ms": summary([r.score_ms for r in replies if r.score_ms is not None]),
            "ttft_ms_scored": summary([r.first_token_ms for r in replies if r.scored]),
            "ttft_ms_unscored": summary([r.first_token_ms for r in replies if not r.scored]),
        },
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def gpu_description() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc.__class__.__name__})"


async def check(args: argparse.Namespace) -> dict:
    port = free_port()
    target = f"127.0.0.1:{port}"
    log_path = args.out.with_suffix(".service.log")
    process = start_service(args, port, log_path)
    try:
        start_s = await wait_serving(process, target, args.start_timeout_s)
        print(f"serving after {start_s:.1f} s; warming up", file=sys.stderr, flush=True)
        await run_level(target, concurrency=2, requests=4, max_tokens=16, deadline_s=args.deadline_s)
        levels = []
        for concurrency in args.concurrency:
            requests = max(args.min_requests, args.rounds * concurrency)
            print(f"concurrency {concurrency}: {requests} requests", file=sys.stderr, flush=True)
            levels.append(await run_level(target, concurrency, requests, args.max_tokens, args.deadline_s))
            print(json.dumps(levels[-1]), file=sys.stderr, flush=True)
    finally:
        stop_service(process)
    return {
        "check": "vllm engine behind the voicemesh LLM service",
        "host": platform.node(),
        "gpu": gpu_description(),
        "model_dir": str(args.model_dir),
        "settings": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "n_ctx": args.n_ctx,
            "max_tokens": args.max_tokens,
        },
        "start_s": round(start_s, 1),
        "levels": levels,
        "service_log": str(log_path),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="Hugging Face model directory vLLM loads")
    parser.add_argument("--out", type=Path, default=Path("vllm-check.json"), help="where the JSON result goes")
    parser.add_argument("--python", default=sys.executable, help="interpreter with voicemesh and vLLM installed")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="concurrency levels")
    parser.add_argument("--rounds", type=int, default=4, help="requests per level = rounds x concurrency ...")
    parser.add_argument("--min-requests", type=int, default=16, help="... but at least this many")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the service's batch cap (vLLM max_num_seqs)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096, help="vLLM max_num_batched_tokens")
    parser.add_argument("--n-ctx", type=int, default=2048, help="context window (vLLM max_model_len)")
    parser.add_argument("--start-timeout-s", type=float, default=600, help="give up if not SERVING by then")
    parser.add_argument("--deadline-s", type=float, default=120, help="deadline of one request")
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"{args.model_dir} has no config.json; pass a Hugging Face model directory")
    args.out = args.out.resolve()
    result = asyncio.run(check(args))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
