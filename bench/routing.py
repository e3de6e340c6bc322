"""LLM routing across two llama.cpp replicas, side by side in one run (`python -m bench.routing`):

- TTFT of a session's second turn with sticky (rendezvous) routing vs round-robin: sticky finds the session's
  saved KV state on its replica; round-robin lands on the other replica and prefills the whole dialogue.
- TTFT under a burst (more requests than slots) with admission on vs off: with admission, a replica refuses
  what would wait past the budget and the gateway's router retries on the next replica; without it, requests
  queue. Latency counted at the client, from send to first token.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterable, Sequence

import grpc

from gateway.backends import Backends
from voicemesh.loadstats import summarize
from voicemesh.mesh import Mesh, free_port
from voicemesh.v1 import llm_pb2, llm_pb2_grpc

QUESTIONS = [
    "I am planning a trip to Italy next month.",
    "My sister just adopted a puppy.",
    "I started learning the piano last week.",
    "We are repainting the kitchen this weekend.",
    "I can never remember where I left my keys.",
    "Our team won the football match yesterday.",
    "I want to cook something new for dinner.",
    "The train was late again this morning.",
]


def _request(
    session_id: str, turns: Sequence[tuple[llm_pb2.Role, str]], max_tokens: int = 24
) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        session_id=session_id,
        messages=[llm_pb2.ChatMessage(role=role, content=text) for role, text in turns],
        max_tokens=max_tokens,
    )


async def _first_token(stream: AsyncIterable[llm_pb2.GenerateResponse]) -> tuple[float, str, str]:
    """(ms from send to first token, replica, reply text)."""
    start = time.monotonic()
    first_ms, replica, text = 0.0, "", []
    async for response in stream:
        if not first_ms:
            first_ms, replica = (time.monotonic() - start) * 1000, response.replica
        text.append(response.text_delta)
    return first_ms, replica, "".join(text)


async def sticky_vs_round_robin(backends: Backends, targets: list[str]) -> dict[str, object]:
    results: dict[str, list[float]] = {"sticky": [], "round_robin": []}
    for mode in results:
        for index, question in enumerate(QUESTIONS):
            session = f"{mode}-{index}"
            first = [(llm_pb2.ROLE_USER, question)]
            _, _, reply = await _first_token(backends.generate(_request(session, first)))
            second = [*first, (llm_pb2.ROLE_ASSISTANT, reply or "I see."), (llm_pb2.ROLE_USER, "Tell me more.")]
            stream: AsyncIterable[llm_pb2.GenerateResponse]
            if mode == "sticky":
                stream = backends.generate(_request(session, second))
            else:  # round-robin: the next replica, not the session's own
                home = backends.llm_order(session)[0]
                other = next(t for t in targets if t != home)
                stream = llm_pb2_grpc.GeneratorStub(backends.channel(other)).Generate(_request(session, second))
            ms, _, _ = await _first_token(stream)
            results[mode].append(ms)
    sticky, rr = statistics.median(results["sticky"]), statistics.median(results["round_robin"])
    return {
        "second_turn_ttft_ms_sticky": summarize(results["sticky"]).to_json(),
        "second_turn_ttft_ms_round_robin": summarize(results["round_robin"]).to_json(),
        "ratio_p50_round_robin_over_sticky": round(rr / sticky, 2),
    }


async def burst(backends: Backends, size: int) -> dict[str, object]:
    async def one(index: int) -> tuple[float, str]:
        try:
            ms, replica, _ = await _first_token(
                backends.generate(_request(f"burst-{index}", [(llm_pb2.ROLE_USER, QUESTIONS[index % 8])], 32))
            )
            return ms, replica
        except Exception as error:
            return -1.0, error.code().name if isinstance(error, grpc.aio.AioRpcError) else "ERROR"

    results = await asyncio.gather(*(one(i) for i in range(size)))
    ok = [ms for ms, _ in results if ms >= 0]
    failed = [status for ms, status in results if ms < 0]
    return {
        "requests": size,
        "ok": len(ok),
        "failed": len(failed),
        "failed_status": sorted(set(failed)),
        "ttft_ms": summarize(ok).to_json(),
    }


async def measure() -> dict[str, object]:
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix="voicemesh-bench-routing-"))
    result: dict[str, object] = {}
    try:
        for admission in ("off", "on"):
            budget = "0" if admission == "off" else "400"
            names = [f"llm-{admission}{i}" for i in range(2)]
            for name in names:
                mesh.start(name, free_port(), ["--replica", name, "--slots", "1", "--max-queue-wait-ms", budget])
            await mesh.wait(names=names)
            targets = [mesh.processes[n].target for n in names]
            backends = Backends("127.0.0.1:1", ",".join(targets), "127.0.0.1:1")
            for target in targets:  # warm both (and let admission measure a service time)
                await _first_token(
                    llm_pb2_grpc.GeneratorStub(backends.channel(target)).Generate(
                        _request("warm", [(llm_pb2.ROLE_USER, "Hello.")])
                    )
                )
            if admission == "off":
                result["routing"] = await sticky_vs_round_robin(backends, targets)
            result[f"burst_admission_{admission}"] = await burst(backends, 12)
            await backends.close()
            for name in names:
                mesh.stop(name)
    finally:
        mesh.stop_all()
    return result


def run() -> dict[str, object]:
    return asyncio.run(measure())


if __name__ == "__main__":
    json.dump(run(), sys.stdout, indent=2)
    print()
