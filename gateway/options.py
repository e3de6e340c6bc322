"""A session's resolved settings: the client's SessionConfig checked against limits, with defaults filled in."""

from __future__ import annotations

from dataclasses import dataclass, field

from voicemesh.errors import check_session_id, invalid, out_of_range
from voicemesh.v1 import asr_pb2, conversation_pb2, tts_pb2

INPUT_RATES_HZ = (16000, 48000)
OUTPUT_RATES_HZ = (16000, 24000, 48000)
MAX_SYSTEM_PROMPT_CHARS = 2000


@dataclass(frozen=True)
class PipelineOptions:
    """Which latency tricks a session uses; the defaults are all on."""

    speculative_start: bool = True
    """Start the reply on the ASR endpoint candidate; its audio is released only once the turn commits."""
    tts_chunking: int = tts_pb2.CHUNKING_POLICY_WORDS
    """When reply text goes to TTS."""
    tts_lookahead_words: int = 2
    """Words of lookahead for word chunking."""
    asr_decode_window: int = asr_pb2.DECODE_WINDOW_TRIMMED
    """Window of the ASR final pass."""
    asr_final_at_silence: bool = True
    """The ASR starts its final pass at the first silence, so it is done when the hangover commits the turn."""
    barge_in: bool = True
    """User speech over the reply interrupts it."""
    barge_in_min_speech_ms: int = 200
    """Speech that long during the reply interrupts it; shorter is a backchannel ("mm-hmm")."""
    max_tokens: int = 48
    """Reply length cap in tokens."""
    buffer_whole_reply: bool = False
    """Baseline: whole LLM reply, then whole synthesis, then send (no streaming between stages)."""
    endpointing: asr_pb2.EndpointingConfig = field(
        default_factory=lambda: asr_pb2.EndpointingConfig(candidate_silence_ms=32, hangover_ms=288)
    )
    """End-of-turn detection for the ASR, in its 32 ms VAD windows. A reply starts (unheard) at the first silent
    window; the turn commits after 9 silent windows (288 ms) and only then is the reply heard. The hangover is
    the floor of voice-to-voice latency, so it is as short as keeps sentences whole: spk1_snt1 pauses ~230 ms
    inside "hurt ... the small dog", which 256 ms splits at 5 of 8 window alignments and 288 ms at none.
    Speakers who pause longer need a longer hangover (per session: options.endpointing)."""


@dataclass(frozen=True)
class SessionOptions:
    session_id: str
    input_rate_hz: int
    output_rate_hz: int
    voice: str
    system_prompt: str
    pipeline: PipelineOptions


def resolve(config: conversation_pb2.SessionConfig, new_id: str) -> SessionOptions:
    """Validate a SessionConfig; raises RequestError naming the field and the allowed values."""
    session_id = config.session_id or new_id
    check_session_id(session_id)
    if config.input_sample_rate_hz not in INPUT_RATES_HZ:
        raise invalid(f"input_sample_rate_hz={config.input_sample_rate_hz} unsupported; send 16000 or 48000")
    output_rate = config.output_sample_rate_hz or 16000
    if output_rate not in OUTPUT_RATES_HZ:
        raise invalid(f"output_sample_rate_hz={output_rate} unsupported; send 16000, 24000 or 48000 (or 0 for 16000)")
    if len(config.system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
        raise out_of_range(
            f"system_prompt has {len(config.system_prompt)} characters; at most {MAX_SYSTEM_PROMPT_CHARS}"
        )
    given = config.options
    default = PipelineOptions()
    lookahead = given.tts_lookahead_words or default.tts_lookahead_words
    if not 1 <= lookahead <= 4:
        raise out_of_range(f"options.tts_lookahead_words={lookahead} out of range; send 1-4 (or 0 for 2)")
    max_tokens = given.max_tokens or default.max_tokens
    if not 1 <= max_tokens <= 512:
        raise out_of_range(f"options.max_tokens={max_tokens} out of range; send 1-512 (or 0 for 48)")
    barge_ms = given.barge_in_min_speech_ms or default.barge_in_min_speech_ms
    if not 50 <= barge_ms <= 3000:
        raise out_of_range(f"options.barge_in_min_speech_ms={barge_ms} out of range; send 50-3000")
    if given.tts_chunking not in tts_pb2.ChunkingPolicy.values():
        raise invalid(f"options.tts_chunking={given.tts_chunking} unknown")
    pipeline = PipelineOptions(
        speculative_start=given.speculative_start if given.HasField("speculative_start") else default.speculative_start,
        tts_chunking=given.tts_chunking or default.tts_chunking,
        tts_lookahead_words=lookahead,
        asr_decode_window=given.asr_decode_window or default.asr_decode_window,
        asr_final_at_silence=given.asr_final_at_silence
        if given.HasField("asr_final_at_silence")
        else default.asr_final_at_silence,
        barge_in=given.barge_in if given.HasField("barge_in") else default.barge_in,
        barge_in_min_speech_ms=barge_ms,
        max_tokens=max_tokens,
        buffer_whole_reply=given.buffer_whole_reply,
        endpointing=_endpointing(given.endpointing, default.endpointing),
    )
    return SessionOptions(
        session_id=session_id,
        input_rate_hz=config.input_sample_rate_hz,
        output_rate_hz=output_rate,
        voice=config.voice,
        system_prompt=config.system_prompt,
        pipeline=pipeline,
    )


def _endpointing(given: asr_pb2.EndpointingConfig, default: asr_pb2.EndpointingConfig) -> asr_pb2.EndpointingConfig:
    """The client's non-zero fields over the gateway's defaults (the ASR service validates the ranges)."""
    merged = asr_pb2.EndpointingConfig()
    merged.CopyFrom(default)
    for name in ("vad_threshold", "candidate_silence_ms", "hangover_ms", "min_speech_ms"):
        if getattr(given, name):
            setattr(merged, name, getattr(given, name))
    if merged.hangover_ms < merged.candidate_silence_ms:
        merged.candidate_silence_ms = merged.hangover_ms
    return merged
