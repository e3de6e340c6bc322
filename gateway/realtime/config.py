"""A Realtime session's settings (`session.update`): checked, kept, described back to the client, and mapped onto a
voicemesh SessionConfig. Turn detection maps onto the ASR's endpointing: server_vad is a fixed silence, semantic_vad
is voicemesh's own scored end of turn, its eagerness the longest wait (docs/decisions/0301)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gateway.options import MAX_SYSTEM_PROMPT_CHARS
from voicemesh.v1 import asr_pb2, conversation_pb2


class RealtimeProblem(Exception):
    """A client event that cannot be carried out: an `error` event, and the connection goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


@dataclass(frozen=True)
class AudioFormat:
    """One of the Realtime formats: its name and the rate it carries (the session's rate in that direction)."""

    type: str
    rate_hz: int

    def describe(self) -> dict[str, Any]:
        return {"type": self.type, "rate": self.rate_hz} if self.type == "audio/pcm" else {"type": self.type}


FORMATS = {
    "audio/pcm": AudioFormat("audio/pcm", 24000),
    "audio/pcmu": AudioFormat("audio/pcmu", 8000),
    "audio/pcma": AudioFormat("audio/pcma", 8000),
}

# semantic_vad's eagerness as the longest wait at a pause scored unfinished and the wait at an unscored one (ms).
EAGERNESS = {"high": (600, 288), "medium": (1200, 288), "auto": (1200, 288), "low": (2400, 500)}
SERVER_VAD_DEFAULTS = {"threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}
MAX_OUTPUT_TOKENS = 512  # the session's max_tokens ceiling (voicemesh.limits.MAX_TOKENS)


@dataclass(frozen=True)
class TurnDetection:
    """`type`: "server_vad", "semantic_vad" or "none" (the client commits and asks for each reply)."""

    type: str = "semantic_vad"
    eagerness: str = "auto"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def describe(self) -> dict[str, Any] | None:
        if self.type == "none":
            return None
        shared = {
            "type": self.type,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }
        if self.type == "semantic_vad":
            return {**shared, "eagerness": self.eagerness}
        return {
            **shared,
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
        }

    def endpointing(self) -> asr_pb2.EndpointingConfig:
        if self.type == "semantic_vad":
            longest_ms, unscored_ms = EAGERNESS[self.eagerness]
            return asr_pb2.EndpointingConfig(max_hangover_ms=longest_ms, hangover_ms=unscored_ms)
        if self.type == "server_vad":
            return asr_pb2.EndpointingConfig(
                fixed_hangover=True, hangover_ms=self.silence_duration_ms, vad_threshold=self.threshold
            )
        return asr_pb2.EndpointingConfig(fixed_hangover=True, hangover_ms=500)  # segments a client commits

    @property
    def replies_on_turns(self) -> bool:
        return self.type != "none" and self.create_response


@dataclass(frozen=True)
class RealtimeConfig:
    """What the client set; the defaults are voicemesh's (its own turn-taking, its default voice)."""

    instructions: str = ""
    voice: str = ""
    input_format: AudioFormat = FORMATS["audio/pcm"]
    output_format: AudioFormat = FORMATS["audio/pcm"]
    turn_detection: TurnDetection = TurnDetection()
    output_modalities: tuple[str, ...] = ("audio",)
    max_output_tokens: int | None = None

    def describe(self, session_id: str, model: str) -> dict[str, Any]:
        """The session as session.created / session.updated show it."""
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": model,
            "instructions": self.instructions,
            "output_modalities": list(self.output_modalities),
            "max_output_tokens": self.max_output_tokens or "inf",
            "audio": {
                "input": {
                    "format": self.input_format.describe(),
                    "transcription": {"model": "voicemesh-asr"},
                    "turn_detection": self.turn_detection.describe(),
                    "noise_reduction": None,
                },
                "output": {"format": self.output_format.describe(), "voice": self.voice, "speed": 1.0},
            },
            "tools": [],
            "tool_choice": "auto",
        }

    def session_config(self, session_id: str) -> conversation_pb2.SessionConfig:
        detection = self.turn_detection
        manual = not detection.replies_on_turns
        options = conversation_pb2.PipelineOptions(
            endpointing=detection.endpointing(),
            barge_in=detection.type != "none" and detection.interrupt_response,
            max_tokens=min(self.max_output_tokens or 0, MAX_OUTPUT_TOKENS),
        )
        if manual:  # no reply starts on its own, so none starts early either
            options.speculative_start = options.prefill_partials = options.start_on_partials = False
        return conversation_pb2.SessionConfig(
            session_id=session_id,
            input_sample_rate_hz=self.input_format.rate_hz,
            output_sample_rate_hz=self.output_format.rate_hz,
            voice=self.voice,
            system_prompt=self.instructions,
            options=options,
        )

    def updated(self, session: object) -> RealtimeConfig:
        """This config with a session.update's `session` applied; RealtimeProblem naming the field otherwise."""
        if not isinstance(session, dict):
            raise RealtimeProblem("session must be an object", "missing_required_parameter", "session")
        config = self
        if "instructions" in session:
            config = dataclasses.replace(config, instructions=_instructions(session["instructions"]))
        if "output_modalities" in session:
            config = dataclasses.replace(config, output_modalities=_modalities(session["output_modalities"]))
        if "max_output_tokens" in session:
            config = dataclasses.replace(config, max_output_tokens=_max_tokens(session["max_output_tokens"]))
        audio = session.get("audio") or {}
        if not isinstance(audio, dict):
            raise RealtimeProblem("session.audio must be an object", param="session.audio")
        given_in, given_out = audio.get("input") or {}, audio.get("output") or {}
        if not isinstance(given_in, dict) or not isinstance(given_out, dict):
            raise RealtimeProblem("session.audio.input and .output must be objects", param="session.audio")
        if "format" in given_in:
            config = dataclasses.replace(config, input_format=_format(given_in["format"], "session.audio.input.format"))
        if "format" in given_out:
            out = _format(given_out["format"], "session.audio.output.format")
            config = dataclasses.replace(config, output_format=out)
        if "voice" in given_out:
            config = dataclasses.replace(config, voice=_voice(given_out["voice"]))
        if "turn_detection" in given_in:
            detection = _turn_detection(given_in["turn_detection"], config.turn_detection)
            config = dataclasses.replace(config, turn_detection=detection)
        return config


def _instructions(value: object) -> str:
    if not isinstance(value, str):
        raise RealtimeProblem("session.instructions must be a string", param="session.instructions")
    if len(value) > MAX_SYSTEM_PROMPT_CHARS:
        raise RealtimeProblem(
            f"session.instructions has {len(value)} characters; at most {MAX_SYSTEM_PROMPT_CHARS}",
            param="session.instructions",
        )
    return value


def _modalities(value: object) -> tuple[str, ...]:
    if value not in (["audio"], ["text"]):
        raise RealtimeProblem(
            f"output_modalities={value!r} unsupported; send ['audio'] (audio and its transcript) or ['text']",
            param="session.output_modalities",
        )
    return ("audio",) if value == ["audio"] else ("text",)


def _max_tokens(value: object) -> int | None:
    if value == "inf" or value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
        raise RealtimeProblem(
            f"max_output_tokens={value!r}; send 1-4096 or 'inf' (replies stop at {MAX_OUTPUT_TOKENS} tokens here)",
            param="session.max_output_tokens",
        )
    return value


def _format(value: object, param: str) -> AudioFormat:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in FORMATS:
        raise RealtimeProblem(f"{param}.type={kind!r} unsupported; send one of {', '.join(FORMATS)}", param=param)
    audio_format = FORMATS[kind]
    rate = value.get("rate", audio_format.rate_hz) if isinstance(value, dict) else None
    if rate != audio_format.rate_hz:
        raise RealtimeProblem(f"{param}.rate={rate!r}: {kind} is {audio_format.rate_hz} Hz", param=f"{param}.rate")
    return audio_format


def _voice(value: object) -> str:
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or len(value) > 128:
        raise RealtimeProblem("session.audio.output.voice must be a voice name", param="session.audio.output.voice")
    return value


def _turn_detection(value: object, current: TurnDetection) -> TurnDetection:
    param = "session.audio.input.turn_detection"
    if value is None:
        return TurnDetection(type="none")
    if not isinstance(value, dict) or value.get("type") not in ("server_vad", "semantic_vad"):
        raise RealtimeProblem(f"{param}.type: send 'server_vad', 'semantic_vad' or turn_detection null", param=param)
    kind = value["type"]
    base = current if current.type == kind else TurnDetection(type=kind)
    fields: dict[str, Any] = {}
    for name in ("create_response", "interrupt_response"):
        if name in value:
            if not isinstance(value[name], bool):
                raise RealtimeProblem(f"{param}.{name} must be true or false", param=f"{param}.{name}")
            fields[name] = value[name]
    if kind == "semantic_vad":
        eagerness = value.get("eagerness", base.eagerness)
        if eagerness not in EAGERNESS:
            raise RealtimeProblem(f"{param}.eagerness={eagerness!r}; send low, medium, high or auto", param=param)
        fields["eagerness"] = eagerness
    else:
        threshold = value.get("threshold", base.threshold)
        if not isinstance(threshold, int | float) or not 0.05 <= threshold <= 0.95:
            raise RealtimeProblem(f"{param}.threshold={threshold!r}; send 0.05-0.95", param=f"{param}.threshold")
        fields["threshold"] = float(threshold)
        for name, low in (("silence_duration_ms", 32), ("prefix_padding_ms", 0)):
            ms = value.get(name, getattr(base, name))
            if not isinstance(ms, int) or isinstance(ms, bool) or not low <= ms <= 10000:
                raise RealtimeProblem(f"{param}.{name}={ms!r}; send {low}-10000", param=f"{param}.{name}")
            fields[name] = ms
    return dataclasses.replace(base, **fields)
