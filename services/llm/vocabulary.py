"""A GGUF whose vocabulary keeps only the tokens Latin-1 text is made of: the same tokens, replies and turn-end
scores for such text, with a smaller output layer to compute at every step.

Gemma 3's vocabulary has 262,144 tokens and ties its output layer to the embeddings, so every decode step reads a
262k x 640 matrix (178 MB at Q8_0, 70% of the file) to score tokens in scripts a voice assistant speaking English,
French or German never writes. The tokens built of ASCII, Latin-1, general punctuation and currency signs, with the
byte tokens and the named control tokens, are 58% of them (152,892); a decode step takes 13.6 ms instead of 18.8 on
2 threads, 28.2 instead of 38.5 on one (`python -m bench.vocabulary`, side by side).

Nothing else changes for text in those characters. A token's merge path in a SentencePiece vocabulary only passes
through its own substrings, which are made of the same characters and so are kept too: such text tokenizes to the
same pieces, and the model computes the same logits for them. What the model can no longer write is a token outside
the set (CJK, emoji), and P(turn end) is normalized over the tokens kept: on 160 points of English it moved by at
most 1.2e-4, and 80 of 80 greedy replies were the same. Text in other scripts still tokenizes, through the byte
tokens, but the model reads it poorly: use the full vocabulary (VOICEMESH_LLM_VOCABULARY=full) for such
conversations.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

LATIN1 = "latin1"
FULL = "full"
VOCABULARIES = (LATIN1, FULL)

_KEPT_CHARACTERS = frozenset(
    [chr(code) for code in range(0x20, 0x7F)]  # ASCII
    + [chr(code) for code in range(0xA0, 0x100)]  # Latin-1: é, ñ, ü, £, °
    + [chr(code) for code in range(0x2010, 0x2027)]  # general punctuation: curly quotes, dashes, ellipsis
    + [chr(code) for code in range(0x20A0, 0x20C1)]  # currency: €, ₹
    + ["\u2581", "\n", "\t"]  # SentencePiece's word-start mark, and the whitespace tokens
)
# gguf.TokenType values (the gguf package is imported only when a vocabulary is cut).
_NORMAL, _CONTROL, _UNUSED = 1, 3, 5
_VOCAB_TENSORS = ("token_embd.weight", "output.weight")  # the tensors with a row per token
_TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


def keeps(piece: str, token_type: int) -> bool:
    """Whether the Latin-1 vocabulary keeps a token: every character of a normal token is kept; of the rest, the
    unused and the control tokens named <unusedN> go (they are never written or read)."""
    if token_type == _NORMAL:
        return all(character in _KEPT_CHARACTERS for character in piece)
    if token_type == _CONTROL:
        return not piece.startswith("<unused")
    return token_type != _UNUSED


def latin1_model(source: Path, cache_dir: Path | None = None) -> Path:
    """`source` with the Latin-1 vocabulary, written once into `cache_dir` (~13 s for Gemma 3 270M) and reused.

    Raises ValueError for a vocabulary that is not SentencePiece's (a BPE vocabulary has merge rules to cut too)."""
    stat = source.stat()
    cache_dir = cache_dir or Path.home() / ".cache" / "voicemesh"
    # The name follows the characters kept and the source's size and time: a new rule or source is cut again.
    rule = hashlib.sha256("".join(sorted(_KEPT_CHARACTERS)).encode()).hexdigest()[:8]
    target = cache_dir / f"{source.stem}.{LATIN1}-{rule}-{stat.st_size:x}-{stat.st_mtime_ns:x}.gguf"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        kept, total = _write_latin1(source, partial)
        partial.rename(target)  # atomic: a reader never sees half a file
    finally:
        partial.unlink(missing_ok=True)
    for stale in cache_dir.glob(f"{source.stem}.{LATIN1}-*.gguf"):
        if stale != target:
            stale.unlink(missing_ok=True)  # an older cut (a process still mapping it keeps its pages)
    log.info("cut the LLM vocabulary to Latin-1", extra={"tokens_kept": kept, "tokens": total, "path": str(target)})
    return target


def _write_latin1(source: Path, target: Path) -> tuple[int, int]:
    """Write `source` with the Latin-1 vocabulary to `target`; returns (tokens kept, tokens before)."""
    import gguf

    reader = gguf.GGUFReader(source)
    fields = reader.fields
    model = fields["tokenizer.ggml.model"].contents() if "tokenizer.ggml.model" in fields else None
    if model != "llama":
        raise ValueError(f"{source.name} has a {model!r} tokenizer; only SentencePiece ('llama') vocabularies are cut")
    token_field = fields["tokenizer.ggml.tokens"]
    pieces = [bytes(token_field.parts[index]) for index in token_field.data]
    types = fields["tokenizer.ggml.token_type"].contents()
    scores = fields["tokenizer.ggml.scores"].contents()
    kept = np.array(
        [
            index
            for index, (piece, kind) in enumerate(zip(pieces, types, strict=True))
            if keeps(piece.decode("utf-8", "replace"), kind)
        ]
    )
    new_id = {int(old): new for new, old in enumerate(kept)}

    writer = gguf.GGUFWriter(target, arch=fields["general.architecture"].contents())
    for key, field in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in _TOKEN_ARRAYS:
            continue
        value = field.contents()
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            if value not in new_id:
                raise ValueError(f"{source.name}: {key}={value} is a token the Latin-1 vocabulary drops")
            value = new_id[value]
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if array else None)
    writer.add_token_list([pieces[index] for index in kept])
    writer.add_token_scores([float(scores[index]) for index in kept])
    writer.add_token_types([int(types[index]) for index in kept])
    for tensor in reader.tensors:
        # Quantized rows are whole blocks (640 = 20 Q8_0 blocks), so taking rows takes their bytes.
        data = np.ascontiguousarray(tensor.data[kept]) if tensor.name in _VOCAB_TENSORS else tensor.data
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(kept), len(pieces)
