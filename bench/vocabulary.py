"""The embedded Gemma 3 270M with its full vocabulary and with the Latin-1 one (services/llm/vocabulary.py), side by
side in one run: is it the same model for English, and how much faster is a step?

- tokens: every sentence of bench/turn_sentences.py, each prompt line and a few lines outside Latin-1, tokenized by
  both (compared as the text of each piece: the ids differ);
- replies: greedy, 24 tokens, to each of the 80 sentences as a user line;
- turn end: P(turn end) after each sentence's words and after its first half, as the LLM service scores it;
- speed: ms per generated token (greedy, 48 tokens after a cached prompt), rounds interleaved, n_threads 2 as the
  service runs; the ratio is full / latin1.
`python -m bench.vocabulary`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from llama_cpp import Llama

from bench import print_result
from bench.turn_sentences import CHECK, READ, TUNE
from services.llm.engine import Message
from services.llm.llama_cpp_engine import default_model_path, end_tokens, logits_at, turn_end_probability
from services.llm.prompt import CompletionPrompt
from services.llm.vocabulary import latin1_model

OUTSIDE_LATIN1 = ("Das Café schließt um 18 Uhr – schade…", "東京の天気は？", "Ça coûte 5 € 🙂", "Привет, как дела?")  # noqa: RUF001 (text in other scripts, on purpose)


def pieces(llama: Llama, text: str) -> list[bytes]:
    """How `llama` tokenizes `text`, as the bytes of each piece (comparable across vocabularies, unlike ids)."""
    return [llama.detokenize([token]) for token in llama.tokenize(text.encode(), add_bos=False)]


def turn_end_after(llama: Llama, ends: np.ndarray, text: str) -> float:
    """P(turn end) after `text` (`ends`: `end_tokens(llama)`), from the logits of its last token."""
    llama.reset()
    llama.eval(llama.tokenize(text.encode(), add_bos=True))
    return turn_end_probability(logits_at(llama, -1), ends)


def run(rounds: int = 5, threads: int = 2) -> dict[str, object]:
    full_path = default_model_path()
    paths = {"full": full_path, "latin1": latin1_model(full_path)}
    models = {
        name: Llama(model_path=str(path), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
        for name, path in paths.items()
    }
    prompt = CompletionPrompt()
    sentences = list(TUNE + CHECK + READ)
    head = prompt.render([Message("user", "Hello.")])
    lines = sentences + head.split("\n")

    different_tokens = [line for line in lines if pieces(models["full"], line) != pieces(models["latin1"], line)]
    outside = {
        text: {name: len(pieces(llama, text)) for name, llama in models.items()}
        | {"round_trip": models["latin1"].detokenize(models["latin1"].tokenize(text.encode(), add_bos=False)).decode()}
        for text in OUTSIDE_LATIN1
    }

    different_replies = []
    for sentence in sentences:
        text = prompt.render([Message("user", sentence)])
        replies = {
            name: llama.create_completion(text, max_tokens=24, temperature=0.0, stop=list(prompt.stop))["choices"][0][
                "text"
            ]
            for name, llama in models.items()
        }
        if replies["full"] != replies["latin1"]:
            different_replies.append({"user": sentence, **replies})

    ends = {name: end_tokens(llama) for name, llama in models.items()}
    differences = []
    for sentence in sentences:
        words = sentence.rstrip(".?!").split()
        for count in (len(words), max(1, len(words) // 2)):
            text = prompt.render([Message("user", " ".join(words[:count]))])
            text = text[: prompt.turn_end_offset(text)]
            full, latin1 = (turn_end_after(models[name], ends[name], text) for name in ("full", "latin1"))
            differences.append(abs(full - latin1))

    step_ms: dict[str, list[float]] = {name: [] for name in models}
    question = prompt.render([Message("user", "Tell me a story about a dragon who lives in the mountains.")])
    for llama in models.values():
        llama.create_completion(question, max_tokens=1)  # the prompt in the cache: only the steps are timed
    for _ in range(rounds):
        for name, llama in models.items():
            started = time.perf_counter()
            output = llama.create_completion(question, max_tokens=48, temperature=0.0, stop=[])
            step_ms[name].append((time.perf_counter() - started) * 1000 / output["usage"]["completion_tokens"])
    medians = {name: round(statistics.median(values), 2) for name, values in step_ms.items()}
    return {
        "vocabulary_tokens": {name: llama.n_vocab() for name, llama in models.items()},
        "lines_tokenized": len(lines),
        "lines_tokenized_differently": different_tokens,
        "outside_latin1_pieces": outside,
        "replies": len(sentences),
        "replies_different": different_replies,
        "turn_end_points": len(differences),
        "turn_end_abs_difference_max": float(max(differences)),
        "turn_end_abs_difference_median": float(statistics.median(differences)),
        "ms_per_token_median": medians,
        "ms_per_token": {name: [round(v, 2) for v in values] for name, values in step_ms.items()},
        "ratio_full_over_latin1": round(medians["full"] / medians["latin1"], 2),
        "threads": threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print_result(run(args.rounds, args.threads))


if __name__ == "__main__":
    main()
