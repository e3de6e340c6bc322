"""The Latin-1 vocabulary the LLM service loads by default: cut from the packaged Gemma 3 270M once, and the same
model as the full one for Latin-1 text (pieces, greedy replies, P(turn end)); other text still round-trips."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from llama_cpp import Llama

from services.llm.engine import Message
from services.llm.llama_common import default_model_path, end_tokens
from services.llm.llama_cpp_engine import logits_at
from services.llm.prompt import CompletionPrompt
from services.llm.server import LlmSettings, build_engine
from services.llm.turn_end import LineEndScorer
from services.llm.vocabulary import keeps, latin1_model
from voicemesh.endpointing import TurnEndCalibration

pytestmark = pytest.mark.integration

SENTENCES = (
    "Can you tell me what the weather will be like tomorrow?",
    "I need to buy a present for my father, who loves gardening.",
    "The café on Rue de Rivoli serves crêpes for €4.50 — not bad…",
    "We are sure that one war is enough",
)


def pieces(llama: Llama, text: str) -> list[bytes]:
    """How `llama` tokenizes `text`, as the bytes of each piece (comparable across vocabularies, unlike ids)."""
    return [llama.detokenize([token]) for token in llama.tokenize(text.encode(), add_bos=False)]


def turn_end_after(llama: Llama, ends: np.ndarray, text: str) -> float:
    """P(turn end) after `text` (`ends`: `end_tokens(llama)`), from the logits of its last token."""
    llama.reset()
    llama.eval(llama.tokenize(text.encode(), add_bos=True))
    return LineEndScorer(ends, TurnEndCalibration()).probability(logits_at(llama, -1))


@pytest.fixture(scope="module")
def models() -> dict[str, Llama]:
    full = default_model_path()
    return {
        name: Llama(model_path=str(path), n_ctx=1024, n_threads=2, verbose=False)
        for name, path in (("full", full), ("latin1", latin1_model(full)))
    }


def test_the_cut_is_written_once_and_reused() -> None:
    first = latin1_model(default_model_path())
    written = first.stat().st_mtime_ns
    assert latin1_model(default_model_path()) == first and first.stat().st_mtime_ns == written
    assert not list(first.parent.glob(f"{first.name}.*.part")), "no partial file is left behind"


def test_latin1_text_is_the_same_to_both_models(models: dict[str, Llama]) -> None:
    full, latin1 = models["full"], models["latin1"]
    assert latin1.n_vocab() < 0.6 * full.n_vocab()
    prompt = CompletionPrompt()
    for sentence in SENTENCES:
        assert pieces(full, sentence) == pieces(latin1, sentence), sentence
    text = prompt.render([Message("user", SENTENCES[0])])
    replies = [
        llama.create_completion(text, max_tokens=16, temperature=0.0, stop=list(prompt.stop))["choices"][0]["text"]
        for llama in (full, latin1)
    ]
    assert replies[0] == replies[1] and replies[0].strip()
    ends = {llama: end_tokens(llama) for llama in (full, latin1)}  # a pass over every token: once per model
    for sentence in SENTENCES:
        text = prompt.render([Message("user", sentence)])
        text = text[: prompt.turn_end_offset(text)]
        scores = [turn_end_after(llama, ends[llama], text) for llama in (full, latin1)]
        assert scores[1] == pytest.approx(scores[0], abs=1e-3), sentence


def test_text_outside_latin1_still_round_trips_through_the_byte_tokens(models: dict[str, Llama]) -> None:
    latin1 = models["latin1"]
    for text in ("東京の天気は？", "Привет 🙂"):  # noqa: RUF001 (other scripts, on purpose)
        tokens = latin1.tokenize(text.encode(), add_bos=False)
        assert latin1.detokenize(tokens).decode() == text
        assert len(tokens) > len(models["full"].tokenize(text.encode(), add_bos=False)), "spelt out in bytes"


def test_what_the_latin1_vocabulary_keeps() -> None:
    assert keeps("\u2581café", 1) and keeps("\u2019s", 1) and keeps("<0xE6>", 6) and keeps("<end_of_turn>", 3)
    assert (
        not keeps("東京", 1)
        and not keeps("\u2581\u041f\u0440\u0438\u0432\u0435\u0442", 1)
        and not keeps("<unused12>", 3)
    )


def test_a_vocabulary_that_is_not_sentencepiece_is_not_cut(tmp_path: Path) -> None:
    path = tmp_path / "bpe.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([b"a", b"b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2' tokenizer; only SentencePiece"):
        latin1_model(path, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir()), "nothing is left in the cache"


def test_an_unknown_vocabulary_setting_is_refused_at_start() -> None:
    with pytest.raises(SystemExit, match="vocabulary='klingon' unknown; use one of latin1, full"):
        build_engine(LlmSettings(vocabulary="klingon"))


def test_a_cache_it_cannot_write_to_leaves_the_whole_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged = default_model_path()
    home = tmp_path / "home"
    home.write_text("a file where the home directory should be")
    monkeypatch.setenv("HOME", str(home))
    engine = build_engine(LlmSettings(model_path=str(packaged)))
    assert engine.model_path == packaged  # type: ignore[attr-defined]  # both llama.cpp engines have it
