"""Train the turn-end probe on real dialogue: `python -m services.llm.train_turn_probe --sgd DIR --taskmaster4 DIR`.

Two steps, each cached under `--work`:
1. `extract`: the served model (the LLM service's default, Latin-1 vocabulary) reads each dialogue in the live prompt's
   format, and at every word end of a user's line keeps the log-probabilities of the candidate next tokens (the most
   frequent next tokens of the training lines), of any line end, and of the likeliest token.
2. `fit`: a logistic probe per feature set on whole dialogues of SGD's train split; the feature set and the operating
   point are chosen on SGD's dev split; SGD's test split and Taskmaster-4 (another corpus) are reported only.

The data is not part of the project: fetch the corpora yourself (see services/llm/turn_probe.md for the sources,
commits and licenses). The result, `services/llm/turn_probe.npz`, is what the LLM service loads.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from services.llm.engine import Message
from services.llm.llama_common import default_model_path, end_tokens, token_piece
from services.llm.prompt import CompletionPrompt
from services.llm.turn_end import operating_point, waits_ms
from services.llm.turn_probe import DEFAULT_PATH, TurnEndProbe, log_softmax_at, model_identity
from services.llm.turn_probe_data import Dialogue, clean, sgd_dialogues, taskmaster_dialogues, with_filler, word_ends
from services.llm.vocabulary import latin1_model
from voicemesh.endpointing import EndpointingPolicy, TurnEndCalibration

USER_TURNS = 4
"""User lines read per dialogue (each with the dialogue so far before it)."""
CANDIDATES = 512
"""Candidate next tokens whose log-probabilities are kept (the probe picks from them)."""
FILLER_SHARE = 0.15
"""Share of user lines that also appear with a filled pause inserted (a point that goes on)."""


class Reader:
    """The served model in a context of its own that returns the logits at chosen rows."""

    def __init__(self, model_path: Path, n_threads: int = 2) -> None:
        import llama_cpp
        from llama_cpp import Llama

        self._lib = llama_cpp
        self.model = Llama(model_path=str(model_path), n_ctx=16, n_batch=16, n_threads=1, verbose=False)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = 2048
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = n_threads
        self.context = llama_cpp.llama_init_from_model(self.model._model.model, params)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.n_vocab = self.model.n_vocab()
        self.model_id = model_identity(self.model.metadata, self.model.n_embd())
        self.end_ids = end_tokens(self.model)
        self.n_past = 0

    def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
        return self.model.tokenize(text.encode(), add_bos=add_bos, special=False)

    def piece(self, token: int) -> str:
        return token_piece(self.model, token).decode("utf-8", "replace")

    def truncate(self, n_past: int) -> None:
        self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(self.context), 0, n_past, -1)
        self.n_past = n_past

    def eval(self, tokens: list[int], rows: Iterable[int] = ()) -> dict[int, np.ndarray]:
        """Evaluate `tokens` after the cache; for each index in `rows`, the logits there."""
        wanted = set(rows)
        out: dict[int, np.ndarray] = {}
        for first in range(0, len(tokens), 512):
            chunk = tokens[first : first + 512]
            batch = self.batch
            batch.n_tokens = len(chunk)
            for index, token in enumerate(chunk):
                batch.token[index] = token
                batch.pos[index] = self.n_past + first + index
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = 0
                batch.logits[index] = (first + index) in wanted
            if self._lib.llama_decode(self.context, batch) != 0:
                raise RuntimeError("llama_decode failed (context full?)")
            for index in range(len(chunk)):
                if first + index in wanted:
                    out[first + index] = np.ctypeslib.as_array(
                        self._lib.llama_get_logits_ith(self.context, index), shape=(self.n_vocab,)
                    ).copy()
        self.n_past += len(tokens)
        return out


def _rows_at(reader: Reader, head: str, line: str, offsets: list[int]) -> tuple[list[int], dict[int, int]]:
    """The tokens of `head + line`, and for each offset in `line` the index of the token ending there (offsets with
    no token boundary there are left out: the live path tokenizes such a prompt in two parts)."""
    tokens = reader.tokenize(head + line)
    ends: dict[int, int] = {}
    decoded = ""
    for index, token in enumerate(tokens):
        decoded += reader.piece(token)
        ends[len(decoded) - len(head)] = index
    return tokens, {offset: ends[offset] for offset in offsets if offset in ends}


def read_points(
    dialogues: list[Dialogue], reader: Reader, featurize: Callable[[np.ndarray], np.ndarray], seed: int
) -> dict[str, np.ndarray]:
    """`featurize` of the logits at every word end of the first USER_TURNS user lines of each dialogue, with its
    label (the line's last word: finished), dialogue number and the words up to it."""
    prompt = CompletionPrompt()
    rng = random.Random(seed)
    header = prompt.render([Message("user", "x")]).rsplit("\nUser: x", 1)[0]
    header_tokens = reader.tokenize(header, add_bos=True)
    reader.truncate(0)
    reader.eval(header_tokens)
    features, labels, dialogue_index, words = [], [], [], []
    for number, dialogue in enumerate(dialogues):
        reader.truncate(len(header_tokens))
        user_turns = 0
        for role, raw in dialogue.lines:
            text = clean(raw)
            if not text:
                continue
            label = "User" if role == "user" else "Assistant"
            if role != "user":
                reader.eval(reader.tokenize(f"\n{label}: {text}"))
                continue
            user_turns += 1
            if user_turns > USER_TURNS:
                break
            variants = [(text, {end: end == word_ends(text)[-1] for end in word_ends(text)})]
            if rng.random() < FILLER_SHARE and (filled := with_filler(text, rng)) is not None:
                filled_text, after_filler = filled
                variants.append((filled_text, {after_filler: False}))
            for variant, points in variants:
                tokens, rows = _rows_at(reader, f"\n{label}: ", variant, sorted(points))
                mark = reader.n_past
                got = reader.eval(tokens, rows.values())
                if variant is not text:  # the filler variant is read aside and dropped again
                    reader.truncate(mark)
                for offset, row in rows.items():
                    features.append(featurize(got[row]))
                    labels.append(points[offset])
                    dialogue_index.append(number)
                    words.append(variant[:offset])
        if number % 100 == 0:
            print(f"  {number}/{len(dialogues)} dialogues, {len(labels)} points", file=sys.stderr, flush=True)
    return {
        "features": np.array(features, dtype=np.float64),
        "label": np.array(labels, dtype=bool),
        "dialogue": np.array(dialogue_index, dtype=np.int32),
        "words": np.array(words, dtype=object),
    }


def at_sentence_ends(dialogues: list[Dialogue], points: Mapping[str, np.ndarray]) -> np.ndarray:
    """For each point, whether its words end a sentence in the text (a `.` `?` or `!` follows them): a point inside a
    turn there is one a reader could take for the end too ("I need a dentist. | One in San Jose")."""
    ends = np.zeros(len(points["label"]), dtype=bool)
    for index, (number, words) in enumerate(zip(points["dialogue"], points["words"], strict=True)):
        for role, raw in dialogues[int(number)].lines:
            line = clean(raw)
            if role == "user" and line.startswith(words) and len(line) > len(words):
                ends[index] = line[len(words)] in ".?!"
                break
    return ends


def extract(
    dialogues: list[Dialogue], reader: Reader, candidates: np.ndarray, end_ids: np.ndarray, seed: int
) -> dict[str, np.ndarray]:
    """The probe's features at every point: the candidates' log P, log P(line ends), the likeliest token's log P."""
    points = read_points(dialogues, reader, lambda row: log_softmax_at(row, candidates, end_ids), seed)
    features = points.pop("features")
    return {
        "logp": features[:, :-2].astype(np.float32),
        "end_logp": features[:, -2].astype(np.float32),
        "top_logp": features[:, -1].astype(np.float32),
        **points,
    }


def choose_candidates(dialogues: list[Dialogue], reader: Reader, count: int) -> list[int]:
    """The `count` tokens that most often follow a word end inside the training lines (what "goes on" looks like),
    plus the line-ending punctuation and the line break."""
    counter: collections.Counter[int] = collections.Counter()
    for dialogue in dialogues:
        for role, raw in dialogue.lines:
            text = clean(raw)
            if role != "user" or not text:
                continue
            for end in word_ends(text)[:-1]:
                following = reader.tokenize(text[end:])
                if following:
                    counter[following[0]] += 1
    forced = [
        t
        for s in (".", "?", "!", "\n", ",", " and", " but", " so", " or", " um", " uh")
        for t in reader.tokenize(s)[:1]
    ]
    chosen = list(dict.fromkeys(forced + [t for t, _ in counter.most_common(count)]))
    return chosen[:count]


# ---- fitting ----------------------------------------------------------------------------------------------------
FEATURE_SETS = {"end": 0, "tokens16": 16, "tokens32": 32, "tokens64": 64}
"""Feature sets compared on the dev split: how many candidate tokens' log-probabilities are read, beside log P(line
ends) and the likeliest token's log P. At most 64: vLLM returns the log-probabilities of at most 128 chosen tokens per
request, and the line ends need the rest, so one probe scores the same on both engines (`--max-tokens` tries more,
for llama.cpp alone)."""
L2 = (0.3, 3.0, 30.0)
POLICY = EndpointingPolicy()


def design(data: Mapping[str, np.ndarray], tokens: int) -> np.ndarray:
    """Columns: log P(line ends), the likeliest token's log P, then the first `tokens` candidates' log P."""
    columns = [data["end_logp"][:, None], data["top_logp"][:, None], data["logp"][:, :tokens]]
    return np.concatenate(columns, axis=1).astype(np.float64)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, iterations: int = 30) -> tuple[np.ndarray, float]:
    """L2-regularized logistic regression by Newton's method on standardized columns; weights for the raw columns."""
    mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-6
    z = np.concatenate([(x - mean) / scale, np.ones((len(x), 1))], axis=1)
    w = np.zeros(z.shape[1])
    penalty = np.full(z.shape[1], l2)
    penalty[-1] = 0.0
    target = y.astype(np.float64)
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-np.clip(z @ w, -50, 50)))
        gradient = z.T @ (p - target) + penalty * w
        hessian = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-6:
            break
    return w[:-1] / scale, float(w[-1] - (w[:-1] * mean / scale).sum())


def predict(x: np.ndarray, weights: np.ndarray, bias: float) -> np.ndarray:
    result: np.ndarray = 1 / (1 + np.exp(-np.clip(x @ weights + bias, -50, 50)))
    return result


def at(p: np.ndarray, y: np.ndarray, calibration: TurnEndCalibration) -> dict[str, float | None]:
    return operating_point(p[y], p[~y], calibration, POLICY)


FINISHED_P90_MS = 600
"""The operating point's bound on dead air after finished turns (90th percentile): no finished turn is left to the
longest wait just for being a little unsure."""


def choose_point(p: np.ndarray, y: np.ndarray) -> TurnEndCalibration:
    """The operating point: of those whose finished turns wait at most FINISHED_P90_MS at the 90th percentile, the
    one with the fewest inside points committing within a 600 ms pause (cut-offs), then the least mean dead air."""
    best: tuple[float, float] | None = None
    chosen = TurnEndCalibration()
    for share in np.arange(0.50, 0.99, 0.01):
        complete_at = float(np.quantile(p[y], 1 - share))
        for ratio in (0.999, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2):
            calibration = TurnEndCalibration(complete_at, max(1e-4, complete_at * ratio))
            finished = waits_ms(p[y], calibration, POLICY)
            if float(np.percentile(finished, 90)) > FINISHED_P90_MS:
                continue
            key = (float((waits_ms(p[~y], calibration, POLICY) < 600).mean()), float(finished.mean()))
            if best is None or key < best:
                best, chosen = key, calibration
    return chosen


def curve(p: np.ndarray, y: np.ndarray) -> list[dict[str, float | None]]:
    """The whole trade-off: for short-wait thresholds from the finished turns' scores (half of them at the short
    wait up to 98%), with the long wait at half that P, what commits where."""
    rows = []
    for share in (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98):
        complete_at = float(np.quantile(p[y], 1 - share))
        rows.append(at(p, y, TurnEndCalibration(complete_at, complete_at / 2)))
    return rows


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    return float(-np.mean(np.where(y, np.log(p + 1e-12), np.log(1 - p + 1e-12))))


def fit(data: dict[str, dict[str, np.ndarray]], meta: dict[str, Any], args: argparse.Namespace) -> dict[str, object]:
    """Fit every feature set on train, pick one and its operating point on dev, save it, report every split."""
    train, dev = data["train"], data["dev"]
    candidates = []
    sets = FEATURE_SETS | {f"tokens{n}": n for n in (128, 256, 512) if n <= args.max_tokens}
    for name, tokens in sets.items():
        for l2 in L2:
            weights, bias = fit_logistic(design(train, tokens), train["label"], l2)
            p_dev = predict(design(dev, tokens), weights, bias)
            calibration = choose_point(p_dev, dev["label"])
            point = at(p_dev, dev["label"], calibration)
            # At each set's own point: the fewest cut-offs, then the least dead air after finished turns.
            dead_air = float(waits_ms(p_dev[dev["label"]], calibration, POLICY).mean())
            key = (point["inside_within_600ms"] or 0.0, dead_air, log_loss(p_dev, dev["label"]))
            candidates.append((key, name, l2, weights, bias, calibration, point))
            print(f"{name} l2={l2}: dev {point} dead air {dead_air:.0f} ms, log loss {key[2]:.4f}", file=sys.stderr)
    key, chosen, l2, weights, bias, calibration, _ = min(candidates, key=lambda c: c[0])
    tokens = sets[chosen]
    probe = TurnEndProbe(
        model_id=meta["model_id"],
        pieces=tuple(meta["pieces"][:tokens]),
        token_weights=weights[2:],
        end_weight=float(weights[0]),
        top_weight=float(weights[1]),
        bias=bias,
        complete_at=calibration.complete_at,
        incomplete_at=calibration.incomplete_at,
    )
    probe.save(args.out, trained_on=SOURCE, feature_set=chosen)
    line_end = TurnEndCalibration()
    held_out: dict[str, object] = {}
    for split in ("dev", "test", "tm4"):
        y = data[split]["label"]
        p = predict(design(data[split], tokens), weights, bias)
        current = np.exp(data[split]["end_logp"].astype(np.float64))
        mid = y | ~data[split]["sentence_end"]  # every finished point, and the inside ones that end no sentence
        held_out[split] = {
            "line_end": at(current, y, line_end),
            "probe": at(p, y, calibration),
            "mid_sentence_line_end": at(current[mid], y[mid], line_end),
            "mid_sentence_probe": at(p[mid], y[mid], calibration),
            "curve_line_end": curve(current, y),
            "curve_probe": curve(p, y),
        }
    return {
        "points": {
            name: {
                "dialogues": len(set(d["dialogue"].tolist())),
                "finished": int(d["label"].sum()),
                "inside": int((~d["label"]).sum()),
                "inside_at_sentence_ends": int((~d["label"] & d["sentence_end"]).sum()),
            }
            for name, d in data.items()
        },
        "feature_sets": [
            {
                "name": c[1],
                "l2": c[2],
                "dev": c[6],
                "dev_dead_air_ms": round(c[0][0]),
                "dev_log_loss": round(c[0][1], 4),
            }
            for c in candidates
        ],
        "chosen": {
            "feature_set": chosen,
            "l2": l2,
            "complete_at": probe.complete_at,
            "incomplete_at": probe.incomplete_at,
        },
        "held_out": held_out,
        "model_id": meta["model_id"],
    }


SOURCE = "SGD train split (github.com/google-research-datasets/dstc8-schema-guided-dialogue@e852981, CC BY-SA 4.0)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sgd", type=Path, help="the SGD checkout (with train/ dev/ test/)")
    parser.add_argument("--taskmaster4", type=Path, help="Taskmaster's TM-4-2024/data")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "voicemesh" / "turn_probe")
    parser.add_argument(
        "--dialogues", type=int, nargs=4, default=(1200, 250, 250, 250), metavar=("TRAIN", "DEV", "TEST", "TM4")
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--max-tokens", type=int, default=64, help="the most candidate tokens a probe may read")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    splits = dict(zip(("train", "dev", "test", "tm4"), args.dialogues, strict=True))
    cached = {name: args.work / f"{name}.npz" for name in splits}
    meta_path = args.work / "meta.json"
    sources = load_sources(args, splits)
    if not all(path.exists() for path in cached.values()) or not meta_path.exists():
        extract_all(sources, args.threads, cached, meta_path)
    meta = json.loads(meta_path.read_text())
    data = {name: dict(np.load(path, allow_pickle=True)) for name, path in cached.items()}
    for name, points in data.items():
        points["sentence_end"] = at_sentence_ends(sources[name], points)
    print(json.dumps(fit(data, meta, args), indent=2))


def held_out_dialogues(sgd: Path | None, taskmaster4: Path | None, count: int) -> dict[str, list[Dialogue]]:
    """The dialogues no probe was fitted or chosen on: SGD's test split and Taskmaster-4, `count` of each (the same
    ones the training script reports on)."""
    sources: dict[str, list[Dialogue]] = {}
    if sgd is not None:
        sources["test"] = list(sgd_dialogues(sgd / "test"))
    if taskmaster4 is not None:
        sources["tm4"] = list(taskmaster_dialogues(taskmaster4))
    for name, dialogues in sources.items():
        random.Random(name).shuffle(dialogues)
        sources[name] = dialogues[:count]
    return sources


def load_sources(args: argparse.Namespace, splits: dict[str, int]) -> dict[str, list[Dialogue]]:
    """Each split's dialogues: a fixed shuffle of the corpus split, cut to the count asked for."""
    if args.sgd is None or args.taskmaster4 is None:
        raise SystemExit("pass --sgd and --taskmaster4 (see services/llm/turn_probe.md)")
    sources = {
        "train": list(sgd_dialogues(args.sgd / "train")),
        "dev": list(sgd_dialogues(args.sgd / "dev")),
        "test": list(sgd_dialogues(args.sgd / "test")),
        "tm4": list(taskmaster_dialogues(args.taskmaster4)),
    }
    for name, dialogues in sources.items():
        random.Random(name).shuffle(dialogues)
        sources[name] = dialogues[: splits[name]]
    return sources


def extract_all(sources: dict[str, list[Dialogue]], threads: int, cached: dict[str, Path], meta_path: Path) -> None:
    reader = Reader(served_model_path(), n_threads=threads)
    candidates = choose_candidates(sources["train"], reader, CANDIDATES)
    meta = {"model_id": reader.model_id, "pieces": [reader.piece(t) for t in candidates]}
    ids = np.array(candidates, dtype=np.int64)
    for name, dialogues in sources.items():
        started = time.monotonic()
        print(f"{name}: {len(dialogues)} dialogues", file=sys.stderr, flush=True)
        features = extract(dialogues, reader, ids, reader.end_ids, seed=len(name))
        np.savez(cached[name], **features)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
        print(f"{name}: {len(features['label'])} points in {time.monotonic() - started:.0f} s", file=sys.stderr)
    meta_path.write_text(json.dumps(meta))


def served_model_path() -> Path:
    """The GGUF the LLM service loads by default (the packaged Gemma 3 270M, Latin-1 vocabulary)."""
    return latin1_model(default_model_path())


if __name__ == "__main__":
    main()
