"""Hypothesis strategies for fuzzing the doors: any protobuf message, mutations of well-formed ones, hostile text and
JSON, and one case type per door (harness/fuzz.py runs them).

Accepted work is kept small on purpose (a few frames, a few words, a few tokens): the fuzz is about what a door
does with odd input, not about load, so a case that a door accepts costs the backends little, and text long enough
to matter is longer than the door's limit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from gateway.protocol import FRAME_HEADER
from voicemesh.audio import samples_per_frame
from voicemesh.v1 import asr_pb2, audio_pb2, conversation_pb2, llm_pb2, tts_pb2

M = TypeVar("M", bound=Message)
T = TypeVar("T")

# Values around the limits the doors check (rates, ranges, sizes) and the ends of the integer types.
INTERESTING_INTS: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 8, 31, 32, 50, 64, 96, 100, 128, 129, 512, 513, 1000, 1200)
INTERESTING_INTS += (2000, 2001, 3000, 4096, 5000, 10000, 10001, 16000, 20000, 22050, 24000, 44100, 48000, 96000)
SPECIAL_TEXT: tuple[str, ...] = ("", " ", "\x00", "\n", "\r\n", "\t", "a\x00b", "\u202e\u0627\u0644", "\ufeff", "...")
SPECIAL_TEXT += (
    "\U0001f600",
    "Hello.",
    "what is two plus two?",
    "User:",
    "\nAssistant:",
    "<|endoftext|>",
    "<start_of_turn>",
)
LONG_PIECES = ("a", "é", "word ", "\U0001f600", "\x07", "Hello. ")
SESSION_RATES = (16000, 48000)
OUTPUT_RATES = (0, 8000, 16000, 22050, 24000, 48000)


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Any integer in [low, high], the interesting ones and the ends more often than chance would give them."""
    special = sorted({value for value in (*INTERESTING_INTS, low, high, -1) if low <= value <= high})
    return st.one_of(st.sampled_from(special), st.integers(low, high))


def hostile_text(max_size: int = 48, long_sizes: Sequence[int] = (129, 2001, 4097, 16001)) -> st.SearchStrategy[str]:
    """Text a client might send: any unicode, control and format characters, markers the prompt format uses, and
    strings just over the doors' length limits (`long_sizes`)."""
    controls = st.characters(codec="utf-8", categories=("Cc", "Cf", "Zs", "Zl", "Zp", "Mn", "So"))
    return st.one_of(
        st.sampled_from(SPECIAL_TEXT),
        st.text(max_size=max_size),
        st.text(controls, max_size=max_size),
        st.builds(lambda piece, size: (piece * size)[:size], st.sampled_from(LONG_PIECES), st.sampled_from(long_sizes)),
    )


JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | hostile_text(max_size=16, long_sizes=(129,)),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=8,
)
"""Any JSON value (NaN and Infinity too, which Python's json writes and reads)."""


# ---- any protobuf message ------------------------------------------------------------------------------------------
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar_values(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type in _INT_RANGES:
        return integers(*_INT_RANGES[field.type])
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if field.type == FieldDescriptor.TYPE_STRING:
        return hostile_text()
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FieldDescriptor.TYPE_ENUM and field.enum_type is not None:
        known = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(known), integers(-(2**31), 2**31 - 1))
    if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
        return messages(message_factory.GetMessageClass(field.message_type), depth - 1)
    raise TypeError(f"field {field.full_name} has a type the fuzzer does not know ({field.type})")


def field_values(field: FieldDescriptor, depth: int = 2) -> st.SearchStrategy[Any]:
    """Values of `field`'s type (lists of them for a repeated field)."""
    values = _scalar_values(field, depth)
    return st.lists(values, max_size=4) if field.is_repeated else values


def set_field(message: Message, field: FieldDescriptor, value: Any) -> None:
    """Set a field of any kind, as a client would."""
    if field.is_repeated:
        target = getattr(message, field.name)
        del target[:]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def messages(cls: type[M], depth: int = 2) -> st.SearchStrategy[M]:
    """Any message of type `cls`: each field unset or any value of its type (sub-messages to `depth`)."""
    if depth <= 0:
        return st.just(cls())
    descriptor: Any = cls.DESCRIPTOR  # upb's or the pure-Python Descriptor, which type checkers tell apart
    optional = {field.name: field_values(field, depth) for field in descriptor.fields}

    def build(values: dict[str, Any]) -> M:
        message = cls()
        for name, value in values.items():
            set_field(message, descriptor.fields_by_name[name], value)
        return message

    return st.fixed_dictionaries({}, optional=optional).map(build)


def field_paths(descriptor: Any, depth: int = 2) -> list[tuple[FieldDescriptor, ...]]:
    """Every field of a message `descriptor` and, to `depth`, of its sub-messages, as paths from the top."""
    paths: list[tuple[FieldDescriptor, ...]] = []
    for field in descriptor.fields:
        paths.append((field,))
        if field.type == FieldDescriptor.TYPE_MESSAGE and not field.is_repeated and depth > 1:
            paths += [(field, *path) for path in field_paths(field.message_type, depth - 1)]
    return paths


def mutated(base: st.SearchStrategy[M], cls: type[M]) -> st.SearchStrategy[M]:
    """A well-formed message from `base` with one to three of its fields (nested ones too) set to any value."""
    paths = field_paths(cls.DESCRIPTOR)

    @st.composite
    def build(draw: st.DrawFn) -> M:
        changed = cls()
        changed.CopyFrom(draw(base))
        for path in draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
            parent: Message = changed
            for field in path[:-1]:
                parent = getattr(parent, field.name)
            set_field(parent, path[-1], draw(field_values(path[-1])))
        return changed

    return build()


def well_formed_or_not(base: st.SearchStrategy[M], cls: type[M]) -> st.SearchStrategy[M]:
    """Well-formed half the time (so that cases get past the first check to the states behind it), well-formed
    with a few fields changed a quarter, any message at all the rest."""
    return st.one_of(base, base, mutated(base, cls), messages(cls))


def short(value: Any, limit: int = 40) -> str:
    """A one-line description of a message or value, long strings and bytes cut to their first characters."""
    if isinstance(value, Message):
        parts = [
            f"{field.name}={short(list(item) if field.is_repeated else item, limit)}"
            for field, item in value.ListFields()
        ]
        return f"{type(value).__name__}({', '.join(parts)})"
    if isinstance(value, bytes) and len(value) > 16:
        return f"<{len(value)} bytes{' of zeros' if not any(value) else ''}>"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}...({len(value)} chars)"
    if isinstance(value, list | tuple):
        shown = ", ".join(short(item, limit) for item in value[:4])
        return f"[{shown}{', ...' if len(value) > 4 else ''}]"
    return repr(value)


# ---- audio --------------------------------------------------------------------------------------------------------
FRAME_SIZES = (0, 1, 2, 3, 638, 639, 641, 1918, 1922, 32000, 32002, 96000, 96002, 5_000_000)
"""Frame sizes around the valid ones (640 and 1920 bytes are 20 ms at 16 and 48 kHz), one second's worth and over
it, and over the 4 MB gRPC message limit."""


def frame_data(size: int, noise: bool) -> bytes:
    """`size` bytes of silence, or of quiet noise that the VAD does not take for speech."""
    if not noise:
        return bytes(size)
    return bytes((index * 7919 % 7) if index % 2 == 0 else 0 for index in range(size))


ENCODING_FIELD: Any = audio_pb2.AudioFrame.DESCRIPTOR.fields_by_name["encoding"]


@st.composite
def _frame_mutation(draw: st.DrawFn, frame: audio_pb2.AudioFrame) -> None:
    kind = draw(st.sampled_from(["data", "size", "encoding", "rate", "seq", "capture_time"]))
    if kind == "data":
        frame.data = draw(st.binary(min_size=0, max_size=4000))
    elif kind == "size":
        frame.data = frame_data(draw(st.sampled_from(FRAME_SIZES)), noise=False)
    elif kind == "encoding":
        frame.encoding = draw(field_values(ENCODING_FIELD))
    elif kind == "rate":
        frame.sample_rate_hz = draw(integers(0, 2**32 - 1))
    elif kind == "seq":
        frame.seq = draw(st.one_of(st.sampled_from([0, frame.seq + 2, max(0, frame.seq - 1)]), integers(0, 2**64 - 1)))
    else:
        frame.capture_time_us = draw(integers(-(2**63), 2**63 - 1))


@st.composite
def audio_frames(draw: st.DrawFn, rate_hz: int, max_frames: int = 30) -> list[audio_pb2.AudioFrame]:
    """20 ms PCM16 frames in order from seq 0, or with a few of them wrong: data, size (empty to huge), encoding,
    rate, seq (gaps, repeats, going back) or capture time. Cases hold no clock reading (capture time 0 is "unknown"),
    so that a case generated again while shrinking is the same case."""
    count = draw(st.integers(0, max_frames))
    noise = draw(st.booleans())
    size = samples_per_frame(rate_hz) * 2
    frames = [
        audio_pb2.AudioFrame(
            data=frame_data(size, noise),
            encoding=audio_pb2.AUDIO_ENCODING_PCM16LE,
            sample_rate_hz=rate_hz,
            seq=seq,
        )
        for seq in range(count)
    ]
    if frames:
        for _ in range(draw(st.integers(0, 3))):
            draw(_frame_mutation(frames[draw(st.integers(0, count - 1))]))
    return frames


# ---- per door ------------------------------------------------------------------------------------------------------
ENDINGS = ("half_close", "cancel", "hold")
"""How a streaming client ends: half-close and wait for the door to end the call, cancel at once after its last
message, or stay silent a while and then cancel."""


@dataclass(frozen=True)
class StreamCase:
    """The requests of one streaming gRPC call, in the order sent, and how the client ends it."""

    requests: tuple[Message, ...]
    ending: str

    def describe(self) -> str:
        return f"{short(list(self.requests), 60)} then {self.ending}"


def _shuffled_in(draw: st.DrawFn, requests: list[T], extras: Sequence[T]) -> list[T]:
    """`requests` with `extras` inserted at drawn places (before the first one too)."""
    for extra in extras:
        requests.insert(draw(st.integers(0, len(requests))), extra)
    return requests


def _out_of_order(draw: st.DrawFn, requests: list[Message]) -> list[Message]:
    """Now and then: the first request (the config) dropped, moved, or sent twice."""
    change = draw(st.sampled_from(["none", "none", "none", "drop_config", "config_later", "config_twice"]))
    if not requests or change == "none":
        return requests
    if change == "drop_config":
        return requests[1:]
    if change == "config_later":
        config = requests.pop(0)
        return _shuffled_in(draw, requests, [config])
    return _shuffled_in(draw, requests, [requests[0]])


def session_configs() -> st.SearchStrategy[conversation_pb2.SessionConfig]:
    """SessionConfigs a well-behaved client sends."""
    options = st.builds(
        conversation_pb2.PipelineOptions,
        max_tokens=st.sampled_from([0, 4, 8]),
        tts_chunking=st.sampled_from(list(tts_pb2.ChunkingPolicy.values())),
        tts_lookahead_words=st.integers(0, 4),
    )
    return st.builds(
        conversation_pb2.SessionConfig,
        input_sample_rate_hz=st.sampled_from(SESSION_RATES),
        output_sample_rate_hz=st.sampled_from(OUTPUT_RATES),
        system_prompt=st.sampled_from(["", "Answer in three words."]),
        options=options,
    )


@st.composite
def converse_cases(draw: st.DrawFn) -> StreamCase:
    """A Converse call: a SessionConfig (well-formed, mutated or random), frames, client reports, now and then out
    of order, then an ending."""
    config = draw(well_formed_or_not(session_configs(), conversation_pb2.SessionConfig))
    rate_hz = config.input_sample_rate_hz if config.input_sample_rate_hz in SESSION_RATES else 16000
    requests: list[Message] = [conversation_pb2.ConverseRequest(config=config)]
    requests += [conversation_pb2.ConverseRequest(frame=frame) for frame in draw(audio_frames(rate_hz))]
    reports = draw(st.lists(messages(conversation_pb2.ClientReport), max_size=2))
    requests = requests[:1] + _shuffled_in(
        draw, requests[1:], [conversation_pb2.ConverseRequest(report=r) for r in reports]
    )
    return StreamCase(tuple(_out_of_order(draw, requests)), draw(st.sampled_from(ENDINGS)))


def recognition_configs() -> st.SearchStrategy[asr_pb2.RecognitionConfig]:
    """RecognitionConfigs a well-behaved caller (the gateway) sends."""
    return st.builds(
        asr_pb2.RecognitionConfig,
        session_id=st.just("fuzz-asr"),
        sample_rate_hz=st.sampled_from(SESSION_RATES),
        language=st.sampled_from(["", "en"]),
        interim_results=st.booleans(),
        decode_window=st.sampled_from(list(asr_pb2.DecodeWindow.values())),
        partial_interval_ms=st.sampled_from([0, 100, 2000]),
        skip_word_timings=st.booleans(),
    )


@st.composite
def recognize_cases(draw: st.DrawFn) -> StreamCase:
    """A StreamingRecognize call: a RecognitionConfig (well-formed, mutated or random), frames, now and then out of
    order, then an ending."""
    config = draw(well_formed_or_not(recognition_configs(), asr_pb2.RecognitionConfig))
    rate_hz = config.sample_rate_hz if config.sample_rate_hz in SESSION_RATES else 16000
    requests: list[Message] = [asr_pb2.RecognizeRequest(config=config)]
    requests += [asr_pb2.RecognizeRequest(frame=frame) for frame in draw(audio_frames(rate_hz))]
    return StreamCase(tuple(_out_of_order(draw, requests)), draw(st.sampled_from(ENDINGS)))


def synthesis_configs() -> st.SearchStrategy[tts_pb2.SynthesisConfig]:
    """SynthesisConfigs a well-behaved caller (the gateway) sends."""
    return st.builds(
        tts_pb2.SynthesisConfig,
        session_id=st.just("fuzz-tts"),
        sample_rate_hz=st.sampled_from(OUTPUT_RATES),
        encoding=st.just(audio_pb2.AUDIO_ENCODING_PCM16LE),
        chunking=st.sampled_from(list(tts_pb2.ChunkingPolicy.values())),
        lookahead_words=st.integers(0, 4),
    )


UTTERANCE_IDS = integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2])
TTS_TEXT = hostile_text(max_size=24, long_sizes=(4097, 5000))
"""Short text (a few words to synthesize), or more than a TextDelta may carry."""


def synthesize_requests() -> st.SearchStrategy[tts_pb2.SynthesizeRequest]:
    """Text deltas, flushes and cancels of a few utterances, and the odd config or empty request."""
    return st.one_of(
        st.builds(
            lambda uid, text: tts_pb2.SynthesizeRequest(text=tts_pb2.TextDelta(utterance_id=uid, text=text)),
            UTTERANCE_IDS,
            TTS_TEXT,
        ),
        st.builds(lambda uid: tts_pb2.SynthesizeRequest(flush=tts_pb2.Flush(utterance_id=uid)), UTTERANCE_IDS),
        st.builds(lambda uid: tts_pb2.SynthesizeRequest(cancel=tts_pb2.Cancel(utterance_id=uid)), UTTERANCE_IDS),
        st.builds(
            lambda traceparent: tts_pb2.SynthesizeRequest(
                text=tts_pb2.TextDelta(utterance_id=1, text="Hi.", traceparent=traceparent)
            ),
            hostile_text(),
        ),
        st.just(tts_pb2.SynthesizeRequest()),
    )


@st.composite
def synthesize_cases(draw: st.DrawFn) -> StreamCase:
    """A StreamingSynthesize call: a SynthesisConfig (well-formed, mutated or random), text, flushes and cancels in
    any order, now and then the config out of place, then an ending."""
    config = draw(well_formed_or_not(synthesis_configs(), tts_pb2.SynthesisConfig))
    requests: list[Message] = [tts_pb2.SynthesizeRequest(config=config)]
    requests += draw(st.lists(synthesize_requests(), max_size=6))
    return StreamCase(tuple(_out_of_order(draw, requests)), draw(st.sampled_from(ENDINGS)))


LLM_TEXT = hostile_text(max_size=48, long_sizes=(4001, 16001, 20000))
"""A few words, or more than a message or the whole prompt may hold (a long prompt that fits would only be slow)."""


def generate_requests() -> st.SearchStrategy[llm_pb2.GenerateRequest]:
    """A GenerateRequest: well-formed (a short dialogue ending with a question, a few tokens), mutated or random."""
    roles = st.sampled_from([llm_pb2.ROLE_SYSTEM, llm_pb2.ROLE_USER, llm_pb2.ROLE_ASSISTANT])
    said = st.sampled_from(["Hi.", "Hello there.", "What is two plus two?"])
    earlier = st.lists(st.builds(llm_pb2.ChatMessage, role=roles, content=said), max_size=3)
    last = st.builds(llm_pb2.ChatMessage, role=st.just(llm_pb2.ROLE_USER), content=said | LLM_TEXT)
    well_formed = st.builds(
        lambda before, user, max_tokens, stop, temperature: llm_pb2.GenerateRequest(
            session_id="fuzz-llm", messages=[*before, user], max_tokens=max_tokens, stop=stop, temperature=temperature
        ),
        earlier,
        last,
        st.integers(1, 4),
        st.lists(hostile_text(max_size=8, long_sizes=(65,)), max_size=2),
        st.sampled_from([0.0, 0.7]),
    )
    return well_formed_or_not(well_formed, llm_pb2.GenerateRequest)


@dataclass(frozen=True)
class WsCase:
    """The messages of one /api/ws connection (text or binary), and how the client ends it: "close" (the client
    closes), "stop" (sends {"type": "stop"} and waits for the door to close) or "wait" (waits, then closes)."""

    messages: tuple[str | bytes, ...]
    ending: str

    def describe(self) -> str:
        return f"{short(list(self.messages), 60)} then {self.ending}"


def _config_json(config: conversation_pb2.SessionConfig) -> Any:
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


CONFIG_KEYS = sorted(field.name for field in conversation_pb2.SessionConfig.DESCRIPTOR.fields)
"""The keys a start message's (or an offer's) config may have."""


@st.composite
def _start_message(draw: st.DrawFn) -> str | bytes:
    config = draw(well_formed_or_not(session_configs(), conversation_pb2.SessionConfig))
    start: dict[str, Any] = {"type": "start", "config": _config_json(config)}
    change = draw(st.sampled_from(["none", "none", "field", "key", "replace", "garbage", "binary"]))
    if change == "field":
        start["config"][draw(st.sampled_from(CONFIG_KEYS))] = draw(JSON_VALUES)
    elif change == "key":
        start[draw(st.sampled_from(["type", "config", "token", "fallback", "extra"]))] = draw(JSON_VALUES)
    elif change == "replace":
        return json.dumps(draw(JSON_VALUES))
    elif change == "garbage":
        return draw(hostile_text(max_size=32, long_sizes=(70_000,)))
    elif change == "binary":
        return draw(st.binary(max_size=64))
    return json.dumps(start)


@st.composite
def ws_cases(draw: st.DrawFn, rate_hz: int = 48000) -> WsCase:
    """A WebSocket session: a start message (well-formed, changed, any JSON, garbage text or binary), then audio
    frames (in order, or a wrong size, header or seq), control messages and garbage, then an ending."""
    items: list[str | bytes] = [draw(_start_message())]
    size = samples_per_frame(rate_hz) * 2
    count = draw(st.integers(0, 20))
    for seq in range(count):
        items.append(FRAME_HEADER.pack(0, seq) + bytes(size))
    extras = draw(
        st.lists(
            st.one_of(
                st.builds(lambda data: data, st.binary(max_size=2000)),
                st.builds(
                    lambda n: FRAME_HEADER.pack(0, 0) + bytes(n), st.sampled_from([0, 1, 640, 1919, 1921, 70_000])
                ),
                st.builds(lambda seq: FRAME_HEADER.pack(0, seq) + bytes(size), integers(0, 2**32 - 1)),
                st.builds(
                    lambda fields: json.dumps({"type": "report", **fields}),
                    st.dictionaries(
                        st.sampled_from(["turn_index", "first_audio_received_us", "x"]), JSON_VALUES, max_size=2
                    ),
                ),
                st.builds(lambda kind: json.dumps({"type": kind}), JSON_VALUES),
                st.builds(json.dumps, JSON_VALUES),
                hostile_text(max_size=32),
            ),
            max_size=3,
        )
    )
    items = items[:1] + _shuffled_in(draw, items[1:], extras)
    return WsCase(tuple(items), draw(st.sampled_from(["close", "stop", "wait"])))


@dataclass(frozen=True)
class HttpCase:
    """One HTTP request to a browser door."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes | None

    def describe(self) -> str:
        headers = {name: short(value) for name, value in self.headers}
        return f"{self.method} {short(self.path)} headers={headers} body={short(self.body, 80)}"


PRINTABLE_LATIN1 = st.characters(min_codepoint=0x20, max_codepoint=0x7E) | st.characters(
    min_codepoint=0xA0, max_codepoint=0xFF
)
HEADER_VALUES = st.text(PRINTABLE_LATIN1, max_size=40) | st.sampled_from(
    ["Bearer ", "Bearer x.y.z", "Basic Zm9vOmJhcg==", "x" * 9000]
)
"""Header values an HTTP client can send (latin-1, no control characters), and one over aiohttp's 8 KB line limit."""
OWN_ORIGIN = "<own>"
"""Stands for the gateway's own page origin (the door fills in its address)."""
ORIGINS = st.sampled_from(
    [None, OWN_ORIGIN, None, OWN_ORIGIN, "https://evil.example", "null", "http://127.0.0.1", "not a url", "http://[::1"]
)
"""No Origin (not a browser), the gateway's own page (half the time), or a page it must refuse."""


def _headers(origin: str | None, extra: dict[str, str]) -> tuple[tuple[str, str], ...]:
    headers = dict(extra)
    if origin is not None:
        headers["Origin"] = origin
    return tuple(headers.items())


def sdp_lines(sdp: str) -> list[str]:
    return [line for line in sdp.splitlines() if line]


@st.composite
def sdp_texts(draw: st.DrawFn, real_offer: str) -> str:
    """A real browser-like offer, that offer with lines dropped, repeated, cut or replaced, or any text."""
    lines = sdp_lines(real_offer)
    change = draw(
        st.sampled_from(["real", "real", "real", "drop", "repeat", "cut", "replace", "value", "any", "sdpish"])
    )
    if change == "drop":
        del lines[draw(st.integers(0, len(lines) - 1))]
    elif change == "repeat":
        index = draw(st.integers(0, len(lines) - 1))
        lines.insert(index, lines[index])
    elif change == "cut":
        lines = lines[: draw(st.integers(0, len(lines)))]
    elif change == "replace":
        lines[draw(st.integers(0, len(lines) - 1))] = draw(hostile_text(max_size=40))
    elif change == "value":
        index = draw(st.integers(0, len(lines) - 1))
        key = lines[index].split("=", 1)[0]
        lines[index] = f"{key}={draw(hostile_text(max_size=40))}"
    elif change == "any":
        return draw(hostile_text(max_size=200, long_sizes=(70_000,)))
    elif change == "sdpish":
        body = draw(st.lists(st.sampled_from(lines) | hostile_text(max_size=30), max_size=12))
        return "\r\n".join(["v=0", "m=audio 9 UDP/TLS/RTP/SAVPF 111", *body]) + "\r\n"
    return "\r\n".join(lines) + "\r\n"


@st.composite
def offer_cases(draw: st.DrawFn, real_offer: str) -> HttpCase:
    """A POST to /api/offer: an offer (real, damaged or any SDP) with a config (well-formed, changed or any JSON), or
    any JSON, or bytes that are not JSON; from our own origin, another, or none."""
    offer: dict[str, Any] = {
        "type": "offer",
        "sdp": draw(sdp_texts(real_offer)),
        "config": _config_json(draw(well_formed_or_not(session_configs(), conversation_pb2.SessionConfig))),
    }
    change = draw(st.sampled_from(["none", "none", "key", "config", "json", "bytes"]))
    body: bytes
    if change == "key":
        offer[draw(st.sampled_from(["type", "sdp", "config"]))] = draw(JSON_VALUES)
    elif change == "config":
        offer["config"] = draw(st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, max_size=3))
    if change == "json":
        body = json.dumps(draw(JSON_VALUES)).encode()
    elif change == "bytes":
        body = draw(st.binary(max_size=200) | st.sampled_from([b"", b"{", b"\xff\xfe", bytes(70_000)]))
    else:
        body = json.dumps(offer).encode()
    content_type = draw(st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]))
    headers = {"Content-Type": content_type} if content_type else {}
    return HttpCase("POST", "/api/offer", _headers(draw(ORIGINS), headers), body)


@st.composite
def config_cases(draw: st.DrawFn) -> HttpCase:
    """A request for /api/config: any method, query string and Authorization header."""
    method = draw(st.sampled_from(["GET", "GET", "GET", "HEAD", "POST", "PUT", "DELETE"]))
    query = draw(st.one_of(st.just(""), st.text(st.characters(codec="ascii", exclude_characters="#"), max_size=30)))
    headers: dict[str, str] = {}
    if draw(st.booleans()):
        headers["Authorization"] = draw(HEADER_VALUES)
    path = "/api/config" + (f"?{query}" if query else "")
    return HttpCase(method, path, _headers(draw(ORIGINS), headers), None)
