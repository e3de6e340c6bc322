"""gRPC Generator service: streamed replies from a pluggable engine (llama.cpp embedded by default)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from opentelemetry.trace import Span, StatusCode

from services.llm.engine import Engine, GenerationRequest, Message
from services.llm.turn_end import SCORERS, TurnEndChoice
from services.llm.turn_probe import ProbeMismatch
from services.llm.vocabulary import LATIN1, VOCABULARIES, latin1_model
from voicemesh import config, serving, telemetry
from voicemesh.admission import Admitted, QueueAdmission, monotonic_ms
from voicemesh.endpointing import TurnEndCalibration
from voicemesh.errors import RequestError, check_session_id, invalid, out_of_range
from voicemesh.limits import MAX_TOKENS, URGENT_WORDS
from voicemesh.serving import OpenCalls, Server, stream_handler, unary_handler
from voicemesh.v1 import llm_pb2, llm_pb2_grpc

log = logging.getLogger(__name__)
TRACER = telemetry.tracer(__name__)

MAX_PROMPT_CHARS = 16_000
MAX_REPLY_PREFIX_CHARS = 4_000
ROLES = {llm_pb2.ROLE_SYSTEM: "system", llm_pb2.ROLE_USER: "user", llm_pb2.ROLE_ASSISTANT: "assistant"}
FINISH = {"stop": llm_pb2.FINISH_REASON_STOP, "length": llm_pb2.FINISH_REASON_LENGTH}
# A call with nothing to send for this long (waiting for a slot, prefilling, sitting out for a new turn) gets an empty
# message: callers hold a replica that sends nothing for 1 s as hung (SIGSTOP, a wedged event loop), before its first
# token as after it, and go to the next replica.
KEEPALIVE_S = 0.25

T = TypeVar("T")


async def with_keepalives(stream: AsyncIterator[T], every_s: float = KEEPALIVE_S) -> AsyncGenerator[T | None, None]:
    """`stream`'s items, and None each time it has been quiet for `every_s`. The next item is awaited in a task of
    its own, so a tick never cancels the engine mid-step; closing this cancels that task (the engine's cleanup runs)."""
    pending: asyncio.Future[T] = asyncio.ensure_future(anext(stream))
    try:
        while True:
            if not (await asyncio.wait({pending}, timeout=every_s))[0]:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(stream))
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending


@dataclasses.dataclass(frozen=True)
class LlmSettings(config.ServerSettings):
    """Settings of the LLM service (flags or VOICEMESH_LLM_* env)."""

    port: int = config.setting(50062, "gRPC port")
    engine: str = config.setting("llama_cpp", "llama_cpp (embedded CPU default) or vllm")
    model_path: str = config.setting("", "GGUF file for llama_cpp; empty = Gemma 3 270M Q4_K_M from its package")
    vocabulary: str = config.setting(
        LATIN1,
        "llama_cpp: latin1 = the GGUF cut to the tokens of ASCII and Latin-1 text, written once into ~/.cache "
        "(same replies and turn-end scores for such text, ~27% less time per token for Gemma 3; a GGUF without a "
        "SentencePiece vocabulary is used whole); full = every token (conversations in other scripts)",
    )
    n_threads: int = config.setting(
        2, "llama.cpp threads for token generation (it slows sharply when the cores are oversubscribed)"
    )
    n_threads_batch: int = config.setting(2, "llama.cpp threads for prompt prefill (time to first token)")
    slots: int = config.setting(
        1, "llama.cpp with max_batch 1: requests served at once (one model copy each); more wait in line"
    )
    max_batch: int = config.setting(
        8,
        "llama_cpp: replies decoded together, one sequence each in one KV cache of one model copy, one decode call "
        "per step (urgent work first, see yield_to_new_turns); more wait in line; 1 = one reply at a time per slot",
    )
    n_ctx: int = config.setting(2048, "context window in tokens")
    prefill_beside_replies: bool = config.setting(
        False,
        "llama_cpp with max_batch > 1: a prefill of a partial also runs beside other sessions' replies (in the steps "
        "without urgent work, while a sequence is free), so more pauses find their turn-end score ready; it costs "
        "CPU that a box near capacity lacks (docs/decisions/0041); false: only while no reply is in flight",
    )
    yield_to_new_turns: bool = config.setting(
        True,
        "llama_cpp: urgent work first. Batched (max_batch > 1): a reply past its urgent words "
        "(GenerateRequest.urgent_words) sits out steps carrying another's urgent work (see continuation_due_s). "
        "max_batch 1: calls are served earliest deadline first (a new call when it arrives, a reply past its urgent "
        "words before its audio would run dry), and a reply gives its slot up between two tokens to an earlier "
        "deadline; false: first come, first served",
    )
    continuation_due_s: float = config.setting(
        2.0,
        "llama_cpp with max_batch > 1 and yield_to_new_turns: a reply past its urgent words sits out the steps that "
        "carry another's urgent work (a prompt, first words) unless its audio would run dry within this many "
        "seconds (docs/decisions/0019)",
    )
    max_ahead_s: float = config.setting(
        0.0,
        "llama_cpp flow control: a reply past its urgent words stops decoding once the text it streamed would take "
        "this long to say beyond its playout (at 15 characters a second), and carries on when it needs more (max_batch "
        "1: when half of that is left, from a saved state). Less decode is thrown away at a barge-in, but the cores "
        "idle while it waits, which did not pay (docs/decisions/0020); 0 = no limit (default), else >= 2",
    )
    first_chunk_yield_ms: float = config.setting(
        0.0,
        "llama_cpp: once a reply's urgent words are out, its decode steps aside this long while the TTS synthesizes "
        "them, for a TTS that shares these cores (a local mesh sets 50; docs/decisions/0014); 0 = never. The "
        "reply's later words come that much later, still seconds ahead of its playout",
    )
    replica: str = config.setting("", "name reported as the serving replica; empty = host name")
    max_queue_wait_ms: float = config.setting(
        2000.0, "refuse (RESOURCE_EXHAUSTED) a request whose expected wait for a slot exceeds this; 0 = never"
    )
    max_num_seqs: int = config.setting(
        8, "vllm: sequences in one batch (the cap that protects p99); more wait in vLLM's queue"
    )
    max_num_batched_tokens: int = config.setting(
        2048, "vllm: tokens per engine step (prefill chunks and decode tokens together)"
    )
    vllm_model_dir: str = config.setting(
        "", "vllm: Hugging Face model directory; empty = model_path, else Gemma 3 270M converted into the cache"
    )
    turn_end_scorer: str = config.setting(
        "line_end",
        "what scores a user's turn end from the logits at their last word: line_end = the probability of a "
        "sentence end or line break there; probe = the learned probe (trained on real dialogue for the default "
        "model: more finished turns answered fast, more clause ends cut; docs/decisions/0034)",
    )
    turn_end_probe: str = config.setting(
        "", "the probe file (turn_end_scorer=probe); empty = the one shipped for Gemma 3 270M"
    )
    turn_end_complete_at: float = config.setting(
        0.0,
        "the score from which a user's turn is taken as finished (the short wait); 0 = the scorer's own (a probe "
        "carries its operating point; line_end's is Gemma 3 270M's). Choose it for another model with "
        "python -m bench.turn_text",
    )
    turn_end_incomplete_at: float = config.setting(
        0.0, "the score up to which a user's turn is taken as unfinished (the longest wait); 0 = the scorer's own"
    )

    def turn_end(self) -> TurnEndChoice:
        """The turn-end scorer to run; a bad setting stops the service at start, saying why."""
        if self.turn_end_scorer not in SCORERS:
            raise SystemExit(f"llm: turn_end_scorer={self.turn_end_scorer!r} unknown; use one of {', '.join(SCORERS)}")
        if not self.turn_end_complete_at and not self.turn_end_incomplete_at:
            return TurnEndChoice(self.turn_end_scorer, self.turn_end_probe)
        try:
            calibration = TurnEndCalibration(self.turn_end_complete_at, self.turn_end_incomplete_at)
        except ValueError as exc:
            raise SystemExit(f"llm: {exc}") from exc
        return TurnEndChoice(self.turn_end_scorer, self.turn_end_probe, calibration)


def to_messages(dialogue: Sequence[llm_pb2.ChatMessage]) -> list[Message]:
    """Validate a request's dialogue (it must end with the user's words) and turn it into the engine's messages."""
    if not dialogue:
        raise invalid("messages is empty; send the dialogue, ending with a ROLE_USER message")
    messages = []
    total = 0
    for index, item in enumerate(dialogue):
        if item.role not in ROLES:
            raise invalid(f"messages[{index}].role={item.role} unknown; send ROLE_SYSTEM, ROLE_USER or ROLE_ASSISTANT")
        if not item.content.strip():
            raise invalid(f"messages[{index}].content is empty")
        if item.interrupted and item.role != llm_pb2.ROLE_ASSISTANT:
            raise invalid(
                f"messages[{index}].interrupted is set on a ROLE_{ROLES[item.role].upper()} message; "
                "only a ROLE_ASSISTANT reply can be interrupted"
            )
        total += len(item.content)
        messages.append(Message(ROLES[item.role], item.content, interrupted=item.interrupted))
    if total > MAX_PROMPT_CHARS:
        raise out_of_range(f"messages hold {total} characters; at most {MAX_PROMPT_CHARS} (trim old turns)")
    if messages[-1].role != "user":
        raise invalid(f"the last message is ROLE_{messages[-1].role.upper()}; it must be ROLE_USER")
    return messages


def to_request(message: llm_pb2.GenerateRequest) -> GenerationRequest:
    """Validate a GenerateRequest and turn it into the engine's request."""
    check_session_id(message.session_id)
    messages = to_messages(message.messages)
    max_tokens = MAX_TOKENS.resolve(message.max_tokens, "max_tokens")
    if len(message.stop) > 8 or any(not 1 <= len(s) <= 64 for s in message.stop):
        raise invalid("stop: send at most 8 strings of 1-64 characters each")
    if not 0 <= message.temperature <= 2:
        raise out_of_range(f"temperature={message.temperature:g} out of range; send 0-2")
    if len(message.reply_prefix) > MAX_REPLY_PREFIX_CHARS or "\n" in message.reply_prefix:
        raise invalid(
            f"reply_prefix holds {len(message.reply_prefix)} characters; send the reply so far: one line of at most "
            f"{MAX_REPLY_PREFIX_CHARS}"
        )
    if not 0 <= message.top_p <= 1:
        raise out_of_range(f"top_p={message.top_p:g} out of range; send 0 < top_p <= 1 (or 0 for 0.95)")
    return GenerationRequest(
        session_id=message.session_id,
        messages=messages,
        max_tokens=max_tokens,
        stop=list(message.stop),
        temperature=message.temperature,
        top_p=message.top_p or 0.95,
        seed=message.seed,
        reply_prefix=message.reply_prefix,
        score_turn_end=message.score_turn_end and not message.reply_prefix,
        urgent_words=URGENT_WORDS.resolve(message.urgent_words, "urgent_words"),
    )


def build_engine(settings: LlmSettings) -> Engine:
    turn_end = settings.turn_end()
    if settings.engine == "llama_cpp":
        from services.llm.llama_common import default_model_path
        from services.llm.llama_cpp_engine import LlamaCppEngine

        path = Path(settings.model_path) if settings.model_path else default_model_path()
        if settings.vocabulary not in VOCABULARIES:
            raise SystemExit(f"llm: vocabulary={settings.vocabulary!r} unknown; use one of {', '.join(VOCABULARIES)}")
        if settings.vocabulary == LATIN1 and path.is_file():  # (a missing file is the engine's to report)
            try:
                path = latin1_model(path)
            except ValueError as exc:
                log.info("the model's vocabulary is used whole", extra={"reason": str(exc)})
            except OSError as exc:  # no room or no write access for the cut: slower, but serving
                log.warning("could not write the Latin-1 cut; the whole vocabulary is used", extra={"error": repr(exc)})
        if settings.max_batch != 1 and settings.slots > 1:
            raise SystemExit("max_batch above 1 decodes every reply in one context: leave slots at 1")
        try:
            if settings.max_batch != 1:
                from services.llm.llama_batch_engine import LlamaBatchEngine

                return LlamaBatchEngine(
                    path,
                    n_threads=settings.n_threads,
                    n_threads_batch=settings.n_threads_batch,
                    max_batch=settings.max_batch,
                    n_ctx=settings.n_ctx,
                    prioritize=settings.yield_to_new_turns,
                    continuation_due_s=settings.continuation_due_s,
                    max_ahead_s=settings.max_ahead_s,
                    first_chunk_yield_s=settings.first_chunk_yield_ms / 1000,
                    turn_end=turn_end,
                    prefill_beside_replies=settings.prefill_beside_replies,
                )
            return LlamaCppEngine(
                path,
                n_threads=settings.n_threads,
                n_threads_batch=settings.n_threads_batch,
                slots=settings.slots,
                n_ctx=settings.n_ctx,
                yield_to_new_turns=settings.yield_to_new_turns,
                max_ahead_s=settings.max_ahead_s,
                first_chunk_yield_s=settings.first_chunk_yield_ms / 1000,
                turn_end=turn_end,
            )
        except ValueError as exc:  # a setting the engine refuses: said at start, not as a traceback
            raise SystemExit(f"llm: {exc}") from exc
    if settings.engine == "vllm":
        from services.llm.convert_gguf import default_model_dir, is_converted
        from services.llm.vllm_engine import VllmEngine

        # The chart names the vLLM model by model_path (VOICEMESH_LLM_MODEL_PATH), as for llama.cpp.
        chosen = settings.vllm_model_dir or settings.model_path
        model_dir = Path(chosen) if chosen else default_model_dir()
        ready = (model_dir / "config.json").is_file() if chosen else is_converted(model_dir)
        if not ready:
            raise SystemExit(
                f"engine=vllm needs a Hugging Face model directory; {model_dir} has none. Convert the packaged "
                "Gemma once with `python -m services.llm.convert_gguf` (make vllm-venv) or pass --vllm-model-dir"
            )
        return VllmEngine(
            model_dir,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.n_ctx,
            turn_end=turn_end,
        )
    raise SystemExit(f"engine={settings.engine!r} unknown; use llama_cpp or vllm")


class GeneratorServicer(llm_pb2_grpc.GeneratorServicer):
    def __init__(self, settings: LlmSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.ready = False
        self.replica = settings.replica or socket.gethostname()
        self.admission = QueueAdmission(engine.capabilities.max_concurrency, settings.max_queue_wait_ms, self.replica)
        telemetry.SLOTS.labels("llm").set(self.admission.slots)
        self.calls = OpenCalls()  # a drain lets the replies in flight finish and refuses new ones

    @stream_handler
    async def Generate(
        self,
        request: llm_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[llm_pb2.GenerateRequest, llm_pb2.GenerateResponse],
    ) -> AsyncIterator[llm_pb2.GenerateResponse]:
        if not self.ready:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the model is still loading; wait for health SERVING")
        generation = to_request(request)
        parent = telemetry.context_from(context.invocation_metadata())
        with self.calls.hold(), self.admission.admit() as admitted:
            self._gauge_admission()
            # Not the current span: this generator may be closed from another task's context (the caller gave up),
            # and detaching a context attached elsewhere is an error. Child spans name it as their parent instead.
            span = TRACER.start_span("llm.generate", context=parent)
            try:
                span.set_attributes(
                    {"session.id": generation.session_id, "replica": self.replica, "model": self.engine.model_name}
                )
                async for response in self._generate(generation, span, admitted):
                    yield response
            except Exception as error:
                span.record_exception(error)
                span.set_status(StatusCode.ERROR, type(error).__name__)
                raise
            finally:
                span.end()
        self._gauge_admission()

    def _gauge_admission(self) -> None:
        """The admission's state on /metrics: requests waiting, and those holding a slot (the batch's occupancy)."""
        telemetry.WAITING.labels("llm").set(max(0, self.admission.in_flight - self.admission.slots))
        telemetry.RUNNING.labels("llm").set(min(self.admission.in_flight, self.admission.slots))

    @unary_handler
    async def Prefill(
        self,
        request: llm_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext[llm_pb2.PrefillRequest, llm_pb2.PrefillResponse],
    ) -> llm_pb2.PrefillResponse:
        if not self.ready:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the model is still loading; wait for health SERVING")
        check_session_id(request.session_id)
        messages = to_messages(request.messages)
        response = llm_pb2.PrefillResponse(replica=self.replica)
        if not self.engine.capabilities.prefills:
            telemetry.PREFILLS.labels("skipped").inc()
            response.skipped = response.unsupported = True
            return response
        with self.calls.hold():
            try:
                done = await self.engine.prefill(request.session_id, messages)
            except ValueError as exc:  # the engine's own limits, e.g. the prompt does not fit the context
                raise out_of_range(str(exc)) from exc
        outcome = "skipped" if done.skipped else "evaluated" if done.evaluated_tokens else "nothing_new"
        telemetry.PREFILLS.labels(outcome).inc()
        response.prompt_tokens = done.prompt_tokens
        response.cached_prompt_tokens = done.cached_tokens
        response.evaluated_tokens = done.evaluated_tokens
        response.skipped = done.skipped
        if done.turn_end is not None:
            response.turn_end.CopyFrom(self._turn_end(done.turn_end, done.score_ms))
        return response

    def _turn_end(self, probability: float, score_ms: float) -> llm_pb2.TurnEnd:
        """The model's score, and the same on the scale every caller reads (this model's calibration applied)."""
        return llm_pb2.TurnEnd(
            probability=self.engine.turn_end_calibration.standard(probability),
            score_ms=score_ms,
            model_probability=probability,
        )

    async def _generate(
        self, generation: GenerationRequest, span: Span, admitted: Admitted
    ) -> AsyncIterator[llm_pb2.GenerateResponse]:
        # With an engine whose replies yield to new ones, a request delays newcomers only until its first token: it
        # leaves the admission queue then, and the service time newcomers wait on is the time to first token.
        yields = self.engine.capabilities.yields_to_new_turns
        first = True
        completion = 0
        slot_since_ms: float | None = None
        arrived_ns = time.time_ns()
        stream = self.engine.generate(generation)
        chunks = with_keepalives(stream)
        try:
            async for chunk in chunks:
                if chunk is None:
                    yield llm_pb2.GenerateResponse()  # a keepalive
                    continue
                if chunk.turn_end is not None:
                    yield llm_pb2.GenerateResponse(turn_end=self._turn_end(chunk.turn_end, chunk.score_ms))
                    continue
                if slot_since_ms is None:
                    slot_since_ms = monotonic_ms() - (chunk.ttft_ms or 0.0)
                response = llm_pb2.GenerateResponse(text_delta=chunk.text)
                if first:
                    first = False
                    now_ns = time.time_ns()
                    queue_ms, ttft_ms = chunk.queue_ms or 0.0, chunk.ttft_ms or 0.0
                    slot_ns = now_ns - int(ttft_ms * 1e6)
                    telemetry.timed_span(TRACER, "llm.queue", arrived_ns, slot_ns, span)
                    telemetry.timed_span(TRACER, "llm.first_token", slot_ns, now_ns, span)
                    telemetry.QUEUE_WAIT.labels("llm").observe(queue_ms / 1000)
                    telemetry.COMPUTE.labels("llm").observe(ttft_ms / 1000)
                    response.queue_ms = chunk.queue_ms or 0.0
                    response.ttft_ms = chunk.ttft_ms or 0.0
                    response.replica = self.replica
                    response.model = self.engine.model_name
                    if yields:
                        admitted.leave()
                        self.admission.record(ttft_ms)
                if chunk.finish_reason:
                    completion = chunk.completion_tokens
                    telemetry.COMPLETION_TOKENS.inc(completion)
                    span.set_attributes(
                        {
                            "prompt_tokens": chunk.prompt_tokens,
                            "cached_prompt_tokens": chunk.cached_prompt_tokens,
                            "completion_tokens": chunk.completion_tokens,
                        }
                    )
                    response.finish_reason = FINISH.get(chunk.finish_reason, llm_pb2.FINISH_REASON_STOP)
                    response.usage.prompt_tokens = chunk.prompt_tokens
                    response.usage.cached_prompt_tokens = chunk.cached_prompt_tokens
                    response.usage.completion_tokens = chunk.completion_tokens
                yield response
        except ValueError as exc:  # the engine's own limits, e.g. the prompt does not fit the context
            raise out_of_range(str(exc)) from exc
        finally:
            await chunks.aclose()  # first: it may be awaiting the engine's next chunk
            await stream.aclose()
            if slot_since_ms is not None and not yields:
                self.admission.record(monotonic_ms() - slot_since_ms)
            log.info("generate done", extra={"session_id": generation.session_id, "completion_tokens": completion})


def build_server(settings: LlmSettings) -> Server:
    settings.turn_end()  # a bad setting stops the service before the model loads
    engine = build_engine(settings)
    servicer = GeneratorServicer(settings, engine)

    async def load() -> None:
        try:
            await engine.start()
        except ProbeMismatch as exc:  # a probe missing, or trained on another model: stop, naming both
            raise SystemExit(f"llm: {exc}") from exc
        servicer.ready = True

    return Server(
        settings,
        [llm_pb2.DESCRIPTOR.services_by_name["Generator"].full_name],
        lambda server: llm_pb2_grpc.add_GeneratorServicer_to_server(servicer, server),
        load,
        unload=engine.close,
        drain=servicer.calls.drain,
    )


def main(argv: Sequence[str] | None = None) -> None:
    settings = config.from_argv(LlmSettings, "llm", argv, prog="voicemesh serve llm")
    serving.run("llm", settings, build_server)


if __name__ == "__main__":
    main()
