"""A session's resolved settings: the client's SessionConfig checked against limits, with defaults filled in."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.turn import TurnPolicy
from voicemesh.endpointing import EndpointingPolicy, policy_from, to_proto
from voicemesh.errors import RequestError, check_session_id, invalid, out_of_range
from voicemesh.limits import INPUT_RATES, LOOKAHEAD_WORDS, MAX_TOKENS, OUTPUT_RATES, URGENT_WORDS
from voicemesh.v1 import asr_pb2, conversation_pb2, tts_pb2

MAX_SYSTEM_PROMPT_CHARS = 2000


_TURN = TurnPolicy()


@dataclass(frozen=True)
class PipelineOptions:
    """Which latency tricks a session uses, and its turn-taking; the defaults are all on."""

    speculative_start: bool = _TURN.speculative_start
    """Start the reply on the ASR endpoint candidate; its audio is released only once the turn commits."""
    prefill_partials: bool = _TURN.prefill_partials
    """While the user speaks, the LLM loads the dialogue with the partial transcript's words into its cache."""
    start_on_partials: bool = _TURN.start_on_partials
    """A partial whose words the LLM scores a finished turn starts the reply before the speech stops."""
    tts_chunking: tts_pb2.ChunkingPolicy = tts_pb2.CHUNKING_POLICY_WORDS
    """When reply text goes to TTS."""
    tts_lookahead_words: int = LOOKAHEAD_WORDS.default
    """Words of lookahead for word chunking."""
    asr_decode_window: asr_pb2.DecodeWindow = asr_pb2.DECODE_WINDOW_TRIMMED
    """Window of the ASR final pass."""
    asr_final_at_silence: bool = True
    """The ASR starts its final pass at the first silence, so it is done when the hangover commits the turn."""
    barge_in: bool = _TURN.barge_in
    """User speech over the reply can interrupt it (gateway/turn.py TurnPolicy has the rules)."""
    barge_in_min_speech_ms: int = _TURN.barge_in_min_speech_ms
    """Wordless speech over the reply this long pauses it."""
    resume_false_interruptions: bool = _TURN.resume_false_interruptions
    """A pause whose speech yields no words resumes the reply."""
    false_interruption_timeout_ms: int = _TURN.false_interruption_timeout_ms
    """How long a paused reply waits for words."""
    backchannels: frozenset[str] = _TURN.backchannels
    """Acknowledgements that do not interrupt."""
    continue_unheard_turns: bool = _TURN.continue_unheard_turns
    """Words over a reply none of which was heard continue the user's turn."""
    max_tokens: int = MAX_TOKENS.default
    """Reply length cap in tokens."""
    buffer_whole_reply: bool = False
    """Baseline: whole LLM reply, then whole synthesis, then send (no streaming between stages)."""
    endpointing: asr_pb2.EndpointingConfig = field(default_factory=lambda: to_proto(EndpointingPolicy()))
    """End-of-turn detection for the ASR (voicemesh/endpointing.py has the defaults and ranges): the reply starts,
    unheard, at the first silent window; the turn commits after a hangover that the pause's completeness score
    picks, and only then is the reply heard."""

    @property
    def urgent_words(self) -> int:
        """Words of a reply its listener waits for before the first audio: with word chunking the TTS's first
        chunk, its first `tts_lookahead_words` words; otherwise the first sentence, or all."""
        if self.tts_chunking == tts_pb2.CHUNKING_POLICY_WORDS and not self.buffer_whole_reply:
            return self.tts_lookahead_words
        return URGENT_WORDS.high

    def turn_policy(self) -> TurnPolicy:
        return TurnPolicy(
            speculative_start=self.speculative_start,
            prefill_partials=self.prefill_partials,
            start_on_partials=self.start_on_partials,
            barge_in=self.barge_in,
            barge_in_min_speech_ms=self.barge_in_min_speech_ms,
            resume_false_interruptions=self.resume_false_interruptions,
            false_interruption_timeout_ms=self.false_interruption_timeout_ms,
            backchannels=self.backchannels,
            continue_unheard_turns=self.continue_unheard_turns,
            scores_pauses=not self.endpointing.fixed_hangover,
            urgent_words=self.urgent_words,
            buffer_whole_reply=self.buffer_whole_reply,
        )


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
    input_rate = INPUT_RATES.check(config.input_sample_rate_hz, "input_sample_rate_hz")
    output_rate = OUTPUT_RATES.check(config.output_sample_rate_hz, "output_sample_rate_hz")
    if len(config.system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
        raise out_of_range(
            f"system_prompt has {len(config.system_prompt)} characters; at most {MAX_SYSTEM_PROMPT_CHARS}"
        )
    given = config.options
    default = PipelineOptions()
    lookahead = LOOKAHEAD_WORDS.resolve(given.tts_lookahead_words, "options.tts_lookahead_words")
    max_tokens = MAX_TOKENS.resolve(given.max_tokens, "options.max_tokens")
    barge_ms = given.barge_in_min_speech_ms or default.barge_in_min_speech_ms
    if not 50 <= barge_ms <= 3000:
        raise out_of_range(
            f"options.barge_in_min_speech_ms={barge_ms} out of range; send 50-3000 (or 0 for {default.barge_in_min_speech_ms})"
        )
    false_ms = given.false_interruption_timeout_ms or default.false_interruption_timeout_ms
    if not 100 <= false_ms <= 5000:
        raise out_of_range(
            f"options.false_interruption_timeout_ms={false_ms} out of range; send 100-5000 "
            f"(or 0 for {default.false_interruption_timeout_ms})"
        )
    if len(given.backchannels) > 64 or any(not 0 < len(b) <= 32 for b in given.backchannels):
        raise out_of_range("options.backchannels: send at most 64 phrases of 1-32 characters each")
    if given.tts_chunking not in tts_pb2.ChunkingPolicy.values():
        raise invalid(f"options.tts_chunking={given.tts_chunking} unknown")
    try:
        endpointing = policy_from(given.endpointing)
    except RequestError as error:
        raise invalid(f"options.{error.message}") from error

    def flag(name: str) -> bool:
        return bool(getattr(given if given.HasField(name) else default, name))

    pipeline = PipelineOptions(
        speculative_start=flag("speculative_start"),
        prefill_partials=flag("prefill_partials"),
        start_on_partials=flag("start_on_partials"),
        tts_chunking=given.tts_chunking or default.tts_chunking,
        tts_lookahead_words=lookahead,
        asr_decode_window=given.asr_decode_window or default.asr_decode_window,
        asr_final_at_silence=flag("asr_final_at_silence"),
        barge_in=flag("barge_in"),
        barge_in_min_speech_ms=barge_ms,
        resume_false_interruptions=flag("resume_false_interruptions"),
        false_interruption_timeout_ms=false_ms,
        backchannels=frozenset(" ".join(b.lower().split()) for b in given.backchannels) or default.backchannels,
        continue_unheard_turns=flag("continue_unheard_turns"),
        max_tokens=max_tokens,
        buffer_whole_reply=given.buffer_whole_reply,
        endpointing=to_proto(endpointing),
    )
    return SessionOptions(
        session_id=session_id,
        input_rate_hz=input_rate,
        output_rate_hz=output_rate,
        voice=config.voice,
        system_prompt=config.system_prompt,
        pipeline=pipeline,
    )
