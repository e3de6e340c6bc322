"""Service-level latency, side by side in one run on the real engines:

- ASR final pass for a 2-3 s utterance: trimmed window (audio + 2 s) vs Whisper's 30 s window;
- LLM time to first token, cold prompt vs the same session's cached prefix, and decode tokens/s;
- TTS time to first audio: `words` chunking (k=2) vs `sentence` chunking, for text streamed like an LLM.

Engines are called directly (no gRPC) so the numbers are the engines' own; `python -m bench.services`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from services.llm.engine import Engine, GenerationRequest, Message

ROOT = Path(__file__).resolve().parents[1]
CLIPS = ROOT.parent / "shared" / "audio"


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def bench_asr(repeats: int = 7) -> dict[str, object]:
    from services.asr.engine import DecodeOptions
    from services.asr.whisper_engine import WhisperTranscriber
    from voicemesh.audio import read_wav

    transcriber = WhisperTranscriber(cpu_threads=2)
    results: dict[str, object] = {}
    for name in ("spk1_snt1", "spk2_snt1"):
        path = CLIPS / f"{name}.wav"
        if not path.exists():
            continue
        audio = read_wav(path).to_rate(16000).samples
        transcriber.transcribe(audio)
        trimmed, full = [], []
        for _ in range(repeats):  # interleaved so drift in machine load hits both alike
            trimmed.append(transcriber.transcribe(audio, DecodeOptions(trimmed=True, word_timings=False)).compute_ms)
            full.append(transcriber.transcribe(audio, DecodeOptions(trimmed=False, word_timings=False)).compute_ms)
        results[name] = {
            "audio_s": round(len(audio) / 16000, 2),
            "trimmed_ms_p50": _median(trimmed),
            "full_window_ms_p50": _median(full),
            "ratio_full_over_trimmed": round(statistics.median(full) / statistics.median(trimmed), 2),
        }
    return results


async def bench_llm(repeats: int = 5) -> dict[str, object]:
    from services.llm.llama_common import default_model_path
    from services.llm.llama_cpp_engine import LlamaCppEngine

    engine = LlamaCppEngine(default_model_path(), n_threads=2)
    await engine.start()
    history = [
        Message("user", "Hi, I am planning a trip to Italy next month."),
        Message("assistant", "That sounds wonderful. Where in Italy are you going?"),
        Message("user", "Rome and Florence. What should I see first?"),
    ]
    cold, cached, rates = [], [], []
    for index in range(repeats):
        # Cold: a session never seen whose prompt differs from its first line on, so only BOS is cached.
        persona = f"Conversation {index}. A friendly voice assistant answers in one short sentence."
        cold_history = [Message("system", persona), *history]
        ttft, _, _ = await _generate(engine, GenerationRequest(f"cold-{index}", cold_history, max_tokens=1))
        cold.append(ttft)
        session = f"warm-{index}"
        # The session's previous turn is in the cache; this turn adds the reply and the new question.
        await _generate(engine, GenerationRequest(session, history[:1], max_tokens=1))
        ttft, tokens, seconds = await _generate(engine, GenerationRequest(session, history, max_tokens=48))
        cached.append(ttft)
        if tokens > 4:
            rates.append(tokens / seconds)
    prompt_tokens = engine.count_tokens(engine.prompt.render(history))
    await engine.close()
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_cold_ms_p50": _median(cold),
        "ttft_cached_prefix_ms_p50": _median(cached),
        "ratio_cold_over_cached": round(statistics.median(cold) / statistics.median(cached), 2),
        "decode_tokens_per_s_p50": round(statistics.median(rates), 1) if rates else None,
    }


async def _generate(engine: Engine, request: GenerationRequest) -> tuple[float, int, float]:
    start = time.monotonic()
    ttft = 0.0
    first_at = start
    tokens = 0
    async for chunk in engine.generate(request):
        if chunk.ttft_ms and not ttft:
            ttft = chunk.ttft_ms
            first_at = time.monotonic()
        if chunk.finish_reason:
            tokens = chunk.completion_tokens
    return ttft, tokens, max(time.monotonic() - first_at, 1e-6)


def bench_tts(repeats: int = 7) -> dict[str, object]:
    from services.tts.chunking import Chunker, Policy
    from services.tts.piper_engine import PiperEngine

    engine = PiperEngine(intra_op_threads=2)
    list(engine.synthesize("Warm up."))
    text = "Rome is a wonderful place to start, with the Colosseum and the Forum right in the center."
    tokens = [w + " " for w in text.split(" ")]
    # An LLM at ~30 tokens/s delivers one word about every 33 ms.
    token_interval_s = 0.033

    def first_audio_ms(policy: Policy) -> float:
        chunker = Chunker(policy, lookahead=2)
        for index, token in enumerate(tokens):
            ready = chunker.push(token)
            if ready:
                arrival_s = index * token_interval_s
                start = time.monotonic()
                next(iter(engine.synthesize(ready[0])))
                return arrival_s * 1000 + (time.monotonic() - start) * 1000
        start = time.monotonic()
        next(iter(engine.synthesize(chunker.flush()[0])))
        return (len(tokens) - 1) * token_interval_s * 1000 + (time.monotonic() - start) * 1000

    words, sentence = [], []
    for _ in range(repeats):
        words.append(first_audio_ms(Policy.WORDS))
        sentence.append(first_audio_ms(Policy.SENTENCE))
    return {
        "text_words": len(tokens),
        "token_interval_ms": token_interval_s * 1000,
        "first_audio_words_k2_ms_p50": _median(words),
        "first_audio_sentence_ms_p50": _median(sentence),
        "ratio_sentence_over_words": round(statistics.median(sentence) / statistics.median(words), 2),
    }


def run() -> dict[str, object]:
    return {"asr_final_pass": bench_asr(), "llm_ttft": asyncio.run(bench_llm()), "tts_first_audio": bench_tts()}


if __name__ == "__main__":
    json.dump(run(), sys.stdout, indent=2)
    print()
