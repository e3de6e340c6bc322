"""The embedded CPU engine, batched: one llama.cpp context decodes every reply in flight together, one sequence each
in one KV cache, one decode call per step, with one copy of the model."""

from __future__ import annotations

import asyncio
import codecs
import collections
import concurrent.futures
import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp._utils import suppress_stdout_stderr

from services.llm.engine import EngineCapabilities, GenerationChunk, GenerationRequest, Message, Prefilled
from services.llm.llama_common import (
    CLOSE_WAIT_S,
    PREFILL_STEP_TOKENS,
    LlamaEngineBase,
    SpeechClock,
    common_prefix,
    past_urgent,
    split_at_turn_end,
    token_piece,
)
from services.llm.prompt import CompletionPrompt
from services.llm.turn_end import TurnEndChoice

log = logging.getLogger(__name__)

N_BATCH = 512  # tokens in one decode call: prompt chunks and every reply's next token together
# A reply past its urgent words sits a step out while another's urgent work (a prompt, or the first words) is in the
# step, unless its audio would run dry within this long (it then needs its next words now). A reply's row costs a
# whole output layer (Gemma 3's 262,144-token vocabulary: more than its transformer layers), so a step with a
# prompt and seven continuations takes about a third longer than the prompt alone. Once back, a reply has to write
# its next chunk (up to 12 words, ~16 steps of ~45 ms with 8 replies in flight) and the TTS has to synthesize it:
# with 8 sessions (bench.scheduling, 48 replies per arrival mode), at 1 s 11 and 20 replies ran dry (up to 0.54 and
# 0.68 s), at 2 s 3 and 12 (up to 0.08 and 0.22 s), never sitting out 7 and 13 (up to 0.36 and 0.21 s); V2V p50 alike.
CONTINUATION_DUE_S = 2.0
# llama-cpp-python's create_completion, which the slot engine uses: the penalty on the last 64 generated tokens,
# and the sampling chain at a temperature above 0.
REPEAT_PENALTY = 1.1
PENALTY_LAST_N = 64
TOP_K = 40
MIN_P = 0.05


@dataclass(eq=False)  # each is itself: compared and hashed by identity
class _Reply:
    """One reply in flight. The engine thread owns every field but `cancelled`."""

    request: GenerationRequest
    prompt: list[int]
    word: int | None  # the prompt position whose logits score the turn end (None: not asked, or no words)
    stops: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue[GenerationChunk | BaseException | None]
    enqueued_ns: int = field(default_factory=time.monotonic_ns)
    admitted_ns: int = 0
    cancelled: bool = False
    seq: int = -1
    cached: int = 0  # prompt tokens found in the KV cache
    position: int = 0  # the next KV position to fill
    pending: list[int] = field(default_factory=list)  # tokens to evaluate: the prompt's rest, then the last sampled
    generated: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far, stop strings not yet ruled out included
    sent: int = 0  # characters of `text` streamed
    first_text: bool = True
    playout: SpeechClock = field(default_factory=SpeechClock)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    prefill: bool = False  # only the prompt into the cache (Engine.prefill): no reply, nobody waits on it
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("ignore"))

    def put(self, item: GenerationChunk | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)

    @property
    def urgent(self) -> bool:
        """Its listener is waiting: the prompt is not in, or the first words are not out. Never a prefill's."""
        return not self.prefill and (self.position < len(self.prompt) or self.playout.started is None)


@dataclass
class _Resident:
    """What one sequence of the KV cache holds between replies."""

    session_id: str | None = None
    tokens: list[int] = field(default_factory=list)
    used: float = 0.0  # time.monotonic of its last reply: the least recently used idle sequence is reused first
    busy: bool = False


@dataclass(frozen=True)
class SavedSequence:
    """A session's sequence, copied out of the KV cache when another session took it over (a few MB)."""

    tokens: list[int]
    data: bytes


class LlamaBatchEngine(LlamaEngineBase):
    """llama.cpp, several replies decoded in one batch: up to `max_batch` sequences in one KV cache, one decode call
    per step carrying every prompt chunk and every reply's next token; more calls wait in line.

    A sequence keeps its session's tokens when its reply ends, so the session's next turn prefills only the new
    ones; a session whose sequence was taken over gets its copy put back. A new session's sequence starts as a copy of
    the prompt's fixed head (persona and examples), which the cache shares rather than duplicates.

    Urgent work goes first: while a step carries a prompt or a reply's first words, the other replies sit it out
    unless their audio would run dry within `continuation_due_s` (`prioritize`; false: every reply in every step).
    A prefill is never in a reply's way (`prefill_skipped`, `prefills_in_the_way`). A cancelled reply stops in a step.
    """

    def __init__(
        self,
        model_path: Path,
        n_threads: int = 2,
        n_threads_batch: int = 2,
        max_batch: int = 8,
        n_ctx: int = 2048,
        saved_sessions: int = 64,
        prompt: CompletionPrompt | None = None,
        prioritize: bool = True,
        continuation_due_s: float = CONTINUATION_DUE_S,
        max_ahead_s: float = 0.0,
        first_chunk_yield_s: float = 0.0,
        turn_end: TurnEndChoice | None = None,
        prefill_beside_replies: bool = False,
    ) -> None:
        if continuation_due_s <= 0:
            raise ValueError(f"continuation_due_s={continuation_due_s:g} must be above 0")
        if not 1 <= max_batch <= 64:
            raise ValueError(f"max_batch={max_batch} out of range; use 1-64")
        super().__init__(
            model_path, n_threads, n_threads_batch, n_ctx, prompt, max_ahead_s, first_chunk_yield_s, turn_end
        )
        self.max_batch = max_batch  # n_ctx is per sequence
        self.prioritize = prioritize
        self.continuation_due_s = continuation_due_s
        self.prefill_beside_replies = prefill_beside_replies
        self.capabilities = EngineCapabilities(max_concurrency=max_batch, scores_turn_end=True, prefills=True)
        self.steps = 0  # decode calls
        self.sat_out = 0  # times a reply was left out of a step (others' urgent work, or max_ahead_s)
        self._threads = n_threads_batch
        self._llama: Llama | None = None
        self._context: llama_cpp.llama_context_p | None = None
        self._batch: llama_cpp.llama_batch | None = None
        self._vocab_size = 0
        self._head: list[int] = []
        self._head_seq = max_batch  # the sequence holding the prompt's fixed head, copied into new sessions'
        self._residents = [_Resident() for _ in range(max_batch)]
        self._saved: collections.OrderedDict[str, SavedSequence] = collections.OrderedDict()
        self._saved_sessions = saved_sessions
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Reply] = collections.deque()
        self._active: list[_Reply] = []
        self._closing = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="llama-batch", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(loaded)

    def _load(self) -> None:
        # The model's weights and tokenizer, with a context of its own too small to matter; replies use `context`.
        model = Llama(model_path=str(self.model_path), n_ctx=16, n_batch=16, n_threads=1, verbose=False)
        params = llama_cpp.llama_context_default_params()
        # One cache for every sequence: a new session's copy of the head shares its cells.
        params.n_ctx = self.n_ctx * (self.max_batch + 1)
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_seq_max = self.max_batch + 1
        params.n_threads = self.n_threads
        params.n_threads_batch = self.n_threads_batch
        params.kv_unified = True
        params.swa_full = True  # Gemma 3's sliding-window layers keep every token, so a prefix can be cut anywhere
        with suppress_stdout_stderr(disable=False):
            context = llama_cpp.llama_init_from_model(model._model.model, params)
        if not context:
            model.close()
            raise RuntimeError("llama.cpp could not create the batched context")
        self._llama, self._context = model, context
        self._batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)
        self._vocab_size = model.n_vocab()
        self._bind_turn_end(model)
        # Warm-up: the first decode allocates compute buffers, and the head every prompt starts with is evaluated once.
        self._head = self._tokenize(self.prompt.render([Message("user", "Hello.")]))
        for first in range(0, len(self._head), N_BATCH):
            chunk = self._head[first : first + N_BATCH]
            self._decode([(token, first + i, self._head_seq, False) for i, token in enumerate(chunk)])

    async def close(self) -> None:
        with self._lock:
            self._closing = True
            for reply in [*self._waiting, *list(self._active)]:
                reply.cancelled = True
            self._lock.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, CLOSE_WAIT_S)
            if self._thread.is_alive():  # freeing the model under a decode would crash the process
                log.warning("the batch thread did not stop within %.0f s; the model stays loaded", CLOSE_WAIT_S)
                return
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._context is not None:
            llama_cpp.llama_free(self._context)
            self._context = None
        if self._llama is not None:
            self._llama.close()
            self._llama = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def count_tokens(self, text: str) -> int:
        return len(self._tokenize(text))

    def _tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        assert self._llama is not None
        return self._llama.tokenize(text.encode(), add_bos=add_bos, special=False)

    # ---- the caller's side -----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        text = self.prompt.render(request.messages, request.reply_prefix)
        prompt = self._tokenize(text)
        room = self.n_ctx - request.max_tokens - 8
        if len(prompt) > room:
            raise ValueError(f"prompt has {len(prompt)} tokens; at most {room} fit with max_tokens")
        word = None
        if request.score_turn_end:
            prompt, word = split_at_turn_end(self._tokenize, self.prompt, text, prompt)
        reply = _Reply(
            request,
            prompt,
            word,
            (*self.prompt.stop, *request.stop),
            asyncio.get_running_loop(),
            asyncio.Queue(),
            rng=np.random.default_rng(request.seed or None),
        )
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is closing")
            self._waiting.append(reply)
            self._lock.notify()
        try:
            while True:
                item = await reply.chunks.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            reply.cancelled = True  # the thread drops it at its next step
            with self._lock:
                self._lock.notify()

    async def prefill(self, session_id: str, messages: list[Message]) -> Prefilled:
        text = self.prompt.prefill_text(messages)
        if text is None:
            return Prefilled()
        prompt = self._tokenize(text)
        if len(prompt) > self.n_ctx - 8:
            raise ValueError(f"prompt has {len(prompt)} tokens; at most {self.n_ctx - 8} fit")
        # Its last token is the user's last word: the logits there score the turn end, as a reply's would.
        word = len(prompt) - 1 if self._scorer is not None else None
        reply = _Reply(
            GenerationRequest(session_id, messages), prompt, word, (), asyncio.get_running_loop(), asyncio.Queue()
        )
        reply.prefill = True
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is closing")
            if prefill_skipped(session_id, self._waiting, self._active, self.max_batch, self.prefill_beside_replies):
                return Prefilled(len(prompt), skipped=True)
            self._waiting.append(reply)
            self._lock.notify()
        scored: GenerationChunk | None = None
        try:
            while (item := await reply.chunks.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                scored = item  # the turn-end score: the only chunk a prefill yields
        finally:
            reply.cancelled = True
            with self._lock:
                self._lock.notify()
        # A prefill dropped before it had a sequence did nothing.
        done = Prefilled(len(prompt), reply.cached, reply.position - reply.cached, skipped=reply.seq < 0)
        if scored is None or scored.turn_end is None:
            return done
        return dataclasses.replace(done, turn_end=scored.turn_end, score_ms=scored.score_ms)

    # ---- the engine thread -----------------------------------------------------------------------------
    def _run(self, loaded: concurrent.futures.Future[None]) -> None:
        # Every llama.cpp computation of the engine runs on this one thread, its warm-up included. llama.cpp's CPU
        # backend parallelizes with OpenMP, and libgomp keeps a team of threads per calling thread: a warm-up on
        # another thread left a second team, and once a process holds more OpenMP threads than it has cores libgomp
        # stops spinning between parallel regions and sleeps instead. A decode step of Gemma 3 270M on 2 threads
        # took 34 ms that way, against 21 ms from one thread (`python -m bench.llm_batch --calling-threads`).
        try:
            self._load()
        except BaseException as error:
            loaded.set_exception(error)
            return
        loaded.set_result(None)
        while True:
            with self._lock:
                while not self._closing and not self._waiting and not self._active:
                    self._lock.wait()
                if self._closing:
                    for reply in [*self._waiting, *self._active]:
                        reply.put(None)
                    return
                self._admit()
            try:
                idle_s = self._step()
                if idle_s is not None:  # every reply is far enough ahead: wait for one to need more, or for news
                    with self._lock:
                        if not self._closing and not self._waiting:
                            self._lock.wait(idle_s)
            except Exception as exc:  # a failed decode fails the replies in it, not the engine
                log.exception("batched decode failed")
                for reply in list(self._active):
                    reply.put(exc)
                    self._finish(reply)
                    self._forget(reply.seq)

    def _forget(self, seq: int) -> None:
        """Empty a sequence whose contents are in doubt."""
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self._context), seq, -1, -1)
        self._residents[seq] = _Resident()

    def _admit(self) -> None:
        """Drop cancelled replies; give waiting ones a sequence while there is one (called with the lock held)."""
        for reply in [r for r in self._active if r.cancelled]:
            self._finish(reply)
            reply.put(None)
        ended = prefills_in_the_way(self._waiting, self._active, self.max_batch, self.prefill_beside_replies)
        for reply in [r for r in self._active if r in ended]:
            self._end_prefill(reply)  # what it evaluated stays in its session's sequence, for that reply
        self._drop([r for r in self._waiting if r.cancelled or r in ended])
        while self._waiting and len(self._active) < self.max_batch:
            reply = next((r for r in self._waiting if not r.prefill), self._waiting[0])  # replies before prefills
            self._waiting.remove(reply)
            try:
                self._assign(reply)
            except Exception as exc:  # e.g. a saved sequence llama.cpp would not take back: this reply fails alone
                log.exception("could not give a reply a sequence")
                reply.put(exc)
                if reply.seq >= 0:
                    self._forget(reply.seq)
                continue
            self._active.append(reply)
            if reply.prefill and not reply.pending:  # its words were all in the cache already
                self._end_prefill(reply)
        self._drop([r for r in self._waiting if r.prefill])  # a prefill never waits in line: its words go stale

    def _drop(self, waiting: list[_Reply]) -> None:
        for reply in waiting:
            self._waiting.remove(reply)
            reply.put(None)

    def _assign(self, reply: _Reply) -> None:
        """A sequence for the reply, holding as much of its prompt as the cache can give."""
        session = reply.request.session_id
        idle = [seq for seq, resident in enumerate(self._residents) if not resident.busy]
        own = [seq for seq in idle if self._residents[seq].session_id == session]
        seq = reply.seq = own[0] if own else min(idle, key=lambda s: self._residents[s].used)
        resident = self._residents[seq]
        memory = llama_cpp.llama_get_memory(self._context)
        if resident.session_id != session:
            if resident.session_id is not None:
                self._save(seq)
            llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
            saved = self._saved.pop(session, None)  # its sequence is the copy now; saved again when taken over
            if saved is not None and common_prefix(saved.tokens, reply.prompt) > common_prefix(
                self._head, reply.prompt
            ):
                self._restore(saved, seq)
                resident.tokens = saved.tokens  # lists here are replaced, never changed in place
            else:
                llama_cpp.llama_memory_seq_cp(memory, self._head_seq, seq, -1, -1)
                resident.tokens = self._head
            resident.session_id = session
        resident.busy = True
        # A reply evaluates at least its last token (its logits are sampled); a prefill may have nothing to do (and
        # then scores nothing).
        cached = min(common_prefix(resident.tokens, reply.prompt), len(reply.prompt) - (not reply.prefill))
        if reply.word is not None and cached < len(reply.prompt):
            cached = min(cached, reply.word)  # its logits are read as it is evaluated
        if cached < len(reply.prompt):  # a prefill of words all cached keeps what follows them too
            llama_cpp.llama_memory_seq_rm(memory, seq, cached, -1)
        reply.cached = reply.position = cached
        reply.pending = reply.prompt[cached:]
        reply.admitted_ns = time.monotonic_ns()

    def _finish(self, reply: _Reply) -> None:
        """The reply leaves the batch; its sequence keeps what it evaluated for the session's next turn."""
        self._active.remove(reply)
        resident = self._residents[reply.seq]
        if not (reply.prefill and reply.cached == len(reply.prompt)):  # a prefill of cached words changed nothing
            resident.tokens = (reply.prompt + reply.generated)[: reply.position]
        resident.busy = False
        resident.used = time.monotonic()

    def _end_prefill(self, reply: _Reply) -> None:
        self._finish(reply)  # first, as for a reply
        reply.put(None)

    def _save(self, seq: int) -> None:
        resident = self._residents[seq]
        assert resident.session_id is not None
        size = llama_cpp.llama_state_seq_get_size(self._context, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._context, buffer, size, seq)
        self._saved[resident.session_id] = SavedSequence(list(resident.tokens), bytes(memoryview(buffer)[:written]))
        self._saved.move_to_end(resident.session_id)
        while len(self._saved) > self._saved_sessions:
            self._saved.popitem(last=False)

    def _restore(self, saved: SavedSequence, seq: int) -> None:
        buffer = (ctypes.c_uint8 * len(saved.data)).from_buffer_copy(saved.data)
        if not llama_cpp.llama_state_seq_set_data(self._context, buffer, len(saved.data), seq):
            raise RuntimeError("llama.cpp did not take the saved sequence back")

    def _step(self) -> float | None:
        """One decode call: every admitted reply's next tokens, urgent ones first. When every reply sits out
        (`max_ahead_s`), no call: the seconds until the first of them needs its next words."""
        now = time.monotonic()
        due_s = self.continuation_due_s if self.prioritize else None
        plan = plan_step(self._active, now, due_s, max_ahead_s=self.max_ahead_s, yield_s=self.first_chunk_yield_s)
        self.sat_out += len(self._active) - len(plan)
        if not plan:
            if not self._active:
                return None
            return max(0.001, min(ready_at(r, self.first_chunk_yield_s, self.max_ahead_s) for r in self._active) - now)
        rows: list[tuple[int, int, int, bool]] = []
        taken: list[tuple[_Reply, int, int]] = []  # reply, its first row, its row count
        for reply, count in plan:
            taken.append((reply, len(rows), count))
            for index in range(count):
                position = reply.position + index
                last = index == count - 1 and count == len(reply.pending)
                wanted = position == reply.word or (last and not reply.prefill)
                rows.append((reply.pending[index], position, reply.seq, wanted))
        urgent = any(reply.urgent for reply, _ in plan)
        if not rows:
            return None
        # Urgent work gets every core (`n_threads_batch`); a step of continuations only, which just has to stay
        # ahead of playout, `n_threads`, leaving the rest to the other stages. llama.cpp would pick by the row count.
        threads = self.n_threads_batch if urgent else self.n_threads
        if threads != self._threads:
            llama_cpp.llama_set_n_threads(self._context, threads, threads)
            self._threads = threads
        self._decode(rows)
        self.steps += 1
        for reply, first_row, count in taken:
            if reply.word is not None and reply.position <= reply.word < reply.position + count:
                assert self._scorer is not None  # a reply is given a word to score only then
                row = self._logits(first_row + reply.word - reply.position)
                probability = self._scorer.probability(row)
                reply.put(
                    GenerationChunk(turn_end=probability, score_ms=(time.monotonic_ns() - reply.admitted_ns) / 1e6)
                )
            reply.position += count
            del reply.pending[:count]
            if reply.pending:
                continue
            if reply.prefill:
                self._end_prefill(reply)
            else:
                self._next_token(reply, self._logits(first_row + count - 1))
        return None

    def _next_token(self, reply: _Reply, logits: np.ndarray) -> None:
        request = reply.request
        token = sample(logits, reply.generated[-PENALTY_LAST_N:], request.temperature, request.top_p, reply.rng)
        reply.generated.append(token)
        assert self._llama is not None
        finish: str | None = None
        if llama_cpp.llama_vocab_is_eog(self._llama._model.vocab, token):
            finish = "stop"
        else:
            delta = reply.decoder.decode(self._piece(token))
            if reply.first_text and not request.reply_prefix:
                delta = delta.lstrip()  # the space after "Assistant:" (a continuation keeps its own)
            reply.text += delta
            stop_at = min((at for at in (reply.text.find(s, reply.sent) for s in reply.stops) if at >= 0), default=-1)
            if stop_at >= 0:
                reply.text = reply.text[:stop_at]
                finish = "stop"
            elif len(reply.generated) >= request.max_tokens:
                finish = "length"
        end = len(reply.text) if finish else len(reply.text) - _held_back(reply.text, reply.stops)
        if end > reply.sent:
            chunk = GenerationChunk(text=reply.text[reply.sent : end])
            reply.sent = end
            if reply.first_text:
                reply.first_text = False
                chunk.queue_ms = (reply.admitted_ns - reply.enqueued_ns) / 1e6
                chunk.ttft_ms = (time.monotonic_ns() - reply.admitted_ns) / 1e6
                chunk.prompt_tokens = len(reply.prompt)
                chunk.cached_prompt_tokens = reply.cached
            reply.put(chunk)
        if reply.playout.started is None and past_urgent(reply.text[: reply.sent], request.urgent_words):
            reply.playout.started = time.monotonic()
        if finish is None:
            reply.pending = [token]
            return
        reply.put(
            GenerationChunk(
                finish_reason=finish,
                ttft_ms=(time.monotonic_ns() - reply.admitted_ns) / 1e6 if reply.first_text else None,
                queue_ms=(reply.admitted_ns - reply.enqueued_ns) / 1e6 if reply.first_text else None,
                prompt_tokens=len(reply.prompt),
                cached_prompt_tokens=reply.cached,
                completion_tokens=len(reply.generated),
            )
        )
        self._finish(reply)  # first: a caller that hears the end may call again at once (a prefill sees it idle)
        reply.put(None)

    def _piece(self, token: int) -> bytes:
        assert self._llama is not None
        return token_piece(self._llama, token)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """Evaluate `rows` of (token, position, sequence, logits wanted) in one call."""
        batch = self._batch
        assert batch is not None
        batch.n_tokens = len(rows)
        for index, (token, position, seq, wanted) in enumerate(rows):
            batch.token[index] = token
            batch.pos[index] = position  # type: ignore[call-overload]  # llama_cpp types pos as an array of arrays
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = seq
            batch.logits[index] = wanted
        result = llama_cpp.llama_decode(self._context, batch)
        if result != 0:
            raise RuntimeError(f"llama_decode returned {result} (1: the KV cache is full)")

    def _logits(self, row: int) -> np.ndarray:
        pointer = llama_cpp.llama_get_logits_ith(self._context, row)
        return np.ctypeslib.as_array(pointer, shape=(self._vocab_size,))


def plan_step(
    replies: list[_Reply],
    now: float,
    due_s: float | None = CONTINUATION_DUE_S,
    budget: int = N_BATCH,
    max_ahead_s: float = 0.0,
    yield_s: float = 0.0,
) -> list[tuple[_Reply, int]]:
    """Which replies go into the next step, and how many of their pending tokens: urgent ones first, in arrival
    order, up to `budget` tokens. A reply past its first words sits out a step that carries urgent work unless its
    audio would run dry within `due_s` (None: it never sits out), and every step until it is `ready_at`. A prefill
    (nobody waits on it) sits out every step that carries urgent work."""
    urgent = any(reply.urgent for reply in replies)
    plan: list[tuple[_Reply, int]] = []
    for reply in sorted(replies, key=lambda r: (not r.urgent, r.enqueued_ns)):
        if budget == 0:
            break
        if reply.prefill:
            if urgent:
                continue
        elif not reply.urgent:
            if ready_at(reply, yield_s, max_ahead_s) > now:
                continue
            if due_s is not None and urgent and reply.playout.runs_dry(reply.text) - now > due_s:
                continue
        count = min(budget, len(reply.pending), PREFILL_STEP_TOKENS if reply.prefill else budget)
        plan.append((reply, count))
        budget -= count
    return plan


def prefill_skipped(
    session_id: str, waiting: collections.deque[_Reply], active: list[_Reply], max_batch: int, beside: bool
) -> bool:
    """Whether a prefill for `session_id` now would be in a reply's way. Beside replies (`beside`): while a reply
    waits for a sequence, none is free, or the session has a call in flight. Otherwise: while any call is."""
    if not beside:
        return bool(waiting or active)
    if waiting or len(active) >= max_batch:
        return True
    return any(r.request.session_id == session_id and not r.cancelled for r in active)


def prefills_in_the_way(
    waiting: collections.deque[_Reply], active: list[_Reply], max_batch: int, beside: bool
) -> list[_Reply]:
    """The prefills (waiting or running) that the waiting replies need ended. Beside replies (`beside`): those of
    the replies' own sessions (a reply takes its session's sequence), then, oldest first, as many others as the
    replies are short of sequences; a prefill otherwise runs on, sitting out the steps with urgent work. Otherwise:
    every prefill, once any reply waits (the engine is no longer idle)."""
    replies = [r for r in waiting if not r.prefill]
    if not replies:
        return []
    prefills = [r for r in waiting if r.prefill]
    running = [r for r in active if r.prefill]
    if not beside:
        return prefills + running
    sessions = {r.request.session_id for r in replies}
    ended = [r for r in prefills + running if r.request.session_id in sessions]
    short = len(replies) - (max_batch - len(active)) - sum(r in running for r in ended)
    others = sorted((r for r in running if r not in ended), key=lambda r: r.enqueued_ns)
    return ended + others[: max(0, short)]


def ready_at(reply: _Reply, yield_s: float, max_ahead_s: float) -> float:
    """When a reply past its first words may decode again (time.monotonic): `yield_s` after they went out (the TTS
    synthesizes them meanwhile), and while its audio runs more than `max_ahead_s` ahead of its listener (flow
    control; 0: no limit), once it no longer does."""
    assert reply.playout.started is not None
    at = reply.playout.started + yield_s
    if max_ahead_s:
        at = max(at, reply.playout.runs_dry(reply.text) - max_ahead_s)
    return at


def sample(logits: np.ndarray, recent: list[int], temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """The next token as llama-cpp-python's `create_completion` picks it: the repeat penalty on the distinct tokens
    among the last ones generated, then greedy at temperature 0, else top-k 40, top-p, min-p 0.05 and the
    temperature before a draw."""
    scores = logits.astype(np.float32, copy=True)
    if recent:
        ids = np.fromiter(set(recent), dtype=np.int64)
        values = scores[ids]
        scores[ids] = np.where(values <= 0, values * REPEAT_PENALTY, values / REPEAT_PENALTY)
    if temperature <= 0:
        return int(np.argmax(scores))
    top = np.argpartition(-scores, TOP_K)[:TOP_K]
    top = top[np.argsort(-scores[top], kind="stable")]
    values = scores[top].astype(np.float64)
    probabilities = np.exp(values - values[0])
    probabilities /= probabilities.sum()
    keep = int(np.searchsorted(np.cumsum(probabilities), top_p) + 1)  # the fewest whose mass reaches top_p
    keep = max(1, min(keep, int(np.sum(probabilities >= MIN_P * probabilities[0]))))
    values = values[:keep] / temperature
    weights = np.exp(values - values[0])
    return int(top[rng.choice(keep, p=weights / weights.sum())])


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin a stop string (they wait for the next token)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
