"""The Realtime conversation as the door tells it: the session's events (as gateway/protocol.py writes them) and its
reply frames in, GA server events out, with the items and responses they name. No I/O: the door sends what it
returns."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway.realtime.audio import AudioOut
from gateway.realtime.config import RealtimeConfig, RealtimeProblem
from gateway.session import ReplyFrame

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


@dataclass
class Item:
    """A conversation item: a user's turn (spoken or typed) or an assistant's reply."""

    id: str
    role: str  # "user" or "assistant"
    content_type: str  # input_audio, input_text, output_audio, output_text
    text: str | None = None  # transcript or text; None while a spoken turn is being transcribed
    status: str = "completed"
    turn_index: int | None = None  # the session's turn that holds it in the history
    audio_ms: float = 0.0  # an assistant item's audio sent so far
    chunks: list[tuple[float, str]] = field(default_factory=list)  # (audio ms at its end, text) of each spoken chunk
    truncated: bool = False  # the client said how much of it was heard: `text` is that

    def describe(self) -> Event:
        text_field = "text" if self.content_type in ("input_text", "output_text") else "transcript"
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": [{"type": self.content_type, text_field: self.text}],
        }

    def heard(self, audio_end_ms: int) -> str:
        """The text of the chunks played whole by `audio_end_ms`: what a barge-in at that point keeps."""
        return " ".join(text for end_ms, text in self.chunks if end_ms <= audio_end_ms + 1)


@dataclass
class Response:
    id: str
    item: Item
    audio: AudioOut
    modalities: tuple[str, ...]
    text: list[str] = field(default_factory=list)
    status: str = "in_progress"
    reason: str | None = None
    cancel_asked: bool = False


class RealtimeConversation:
    """Items, responses and the events that announce them, for one connection."""

    def __init__(self, config: RealtimeConfig) -> None:
        self.config = config
        self.items: dict[str, Item] = {}
        self.responses: dict[int, Response] = {}  # by the session's turn index
        self.unanswered: list[Item] = []  # user items no response has answered yet
        self.held: list[str] = []  # with turn detection off: transcripts of the audio not committed yet
        self.speech_item: Item | None = None  # the user's turn being spoken (server VAD)
        self.partial_sent = ""
        self.awaiting_final = False  # speech started whose transcript has not come
        self.speaking = False
        self._event_ids = itertools.count()
        self._last_item_id: str | None = None

    @property
    def last_item_id(self) -> str | None:
        return self._last_item_id

    # ---- events ------------------------------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "event_id": f"event_{next(self._event_ids)}", **fields}

    def error(
        self, problem: RealtimeProblem, event_id: str | None = None, kind: str = "invalid_request_error"
    ) -> Event:
        error = {"type": kind, "code": problem.code, "message": problem.message, "param": problem.param}
        return self.event("error", error={**error, "event_id": event_id})

    def add_item(self, item: Item) -> list[Event]:
        previous, self._last_item_id = self._last_item_id, item.id
        self.items[item.id] = item
        return [self.event("conversation.item.added", previous_item_id=previous, item=item.describe())]

    def item_done(self, item: Item) -> Event:
        return self.event("conversation.item.done", item=item.describe())

    # ---- the user's side ---------------------------------------------------------------------------------------
    def speech(self, started: bool, audio_ms: float) -> list[Event]:
        """The VAD's speech start or stop (each told once, in pairs); told to the client with turn detection on."""
        if started:
            self.awaiting_final = True
        if self.speaking == started:
            return []
        self.speaking = started
        if self.config.turn_detection.type == "none":
            return []
        if started:
            if self.speech_item is None:
                self.speech_item = Item(new_id("item"), "user", "input_audio", status="in_progress")
                self.partial_sent = ""
            return [
                self.event(
                    "input_audio_buffer.speech_started", audio_start_ms=round(audio_ms), item_id=self.speech_item.id
                )
            ]
        item_id = self.speech_item.id if self.speech_item is not None else new_id("item")
        return [self.event("input_audio_buffer.speech_stopped", audio_end_ms=round(audio_ms), item_id=item_id)]

    def partial(self, text: str) -> list[Event]:
        item = self.speech_item
        if item is None or not text.startswith(self.partial_sent) or text == self.partial_sent:
            return []  # transcription deltas only add; a partial that rewrote earlier words waits for the final
        delta, self.partial_sent = text[len(self.partial_sent) :], text
        return [
            self.event(
                "conversation.item.input_audio_transcription.delta", item_id=item.id, content_index=0, delta=delta
            )
        ]

    def user_turn(self, turn_index: int, text: str) -> list[Event]:
        """The session committed a spoken turn (or, without replies on turns, held one)."""
        detection = self.config.turn_detection
        self.awaiting_final = False
        if detection.type == "none":
            self.held.append(text)  # the client's commit makes the item
            self.speech_item = None
            return []
        item = self.speech_item or Item(new_id("item"), "user", "input_audio")
        self.speech_item = None
        previous = self._last_item_id
        events = [self.event("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id)]
        events += self.add_item(item)
        events += self.transcribed(item, text)
        if detection.replies_on_turns:
            item.turn_index = turn_index
            events += self.begin_response(turn_index)
        else:
            self.unanswered.append(item)
        return events

    def transcribed(self, item: Item, text: str) -> list[Event]:
        item.text, item.status = text, "completed"
        seconds = round(len(text.split()) / 2.5, 2)  # the ASR reports no duration; the words' speaking time
        completed = self.event(
            "conversation.item.input_audio_transcription.completed",
            item_id=item.id,
            content_index=0,
            transcript=text,
            usage={"type": "duration", "seconds": seconds},
        )
        return [completed, self.item_done(item)]

    def typed(self, text: str) -> list[Event]:
        item = Item(new_id("item"), "user", "input_text", text=text)
        self.unanswered.append(item)
        return [*self.add_item(item), self.item_done(item)]

    # ---- responses ---------------------------------------------------------------------------------------------
    @property
    def active(self) -> Response | None:
        return next((r for r in self.responses.values() if r.status == "in_progress"), None)

    def begin_response(self, turn_index: int) -> list[Event]:
        modalities = self.config.output_modalities
        content = "output_text" if modalities == ("text",) else "output_audio"
        item = Item(new_id("item"), "assistant", content, text="", status="in_progress", turn_index=turn_index)
        response = Response(new_id("resp"), item, AudioOut(self.config.output_format), modalities)
        self.responses[turn_index] = response
        for answered in self.unanswered:
            answered.turn_index = turn_index
        self.unanswered = []
        part = {"type": "text", "text": ""} if content == "output_text" else {"type": "audio", "transcript": ""}
        where = {"response_id": response.id, "item_id": item.id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.created", response=self._describe(response)),
            self.event("response.output_item.added", response_id=response.id, output_index=0, item=item.describe()),
            *self.add_item(item),
            self.event("response.content_part.added", part=part, **where),
        ]

    def _response(self, turn_index: int) -> tuple[Response | None, list[Event]]:
        """The live response of a turn; one the session began on its own starts here."""
        response = self.responses.get(turn_index)
        if response is None:
            events = self.begin_response(turn_index)
            return self.responses[turn_index], events
        return (response if response.status == "in_progress" else None), []

    def reply_text(self, turn_index: int, delta: str) -> list[Event]:
        response, events = self._response(turn_index)
        if response is None or not delta:
            return events
        response.text.append(delta)
        kind = (
            "response.output_text.delta"
            if response.modalities == ("text",)
            else "response.output_audio_transcript.delta"
        )
        return [*events, self.event(kind, delta=delta, **self._where(response))]

    def audio(self, frame: ReplyFrame) -> list[Event]:
        response, events = self._response(frame.turn_index)
        if response is None or response.cancel_asked or response.modalities == ("text",):
            return events
        item = response.item
        delta = response.audio.encode(frame.speech.frame.data)
        item.audio_ms = response.audio.sent_ms
        if frame.speech.chunk_end:
            item.chunks.append((item.audio_ms, frame.speech.text))
        return [*events, self.event("response.output_audio.delta", delta=delta, **self._where(response))]

    def finish(self, turn_index: int, status: str, spoken: str | None = None, reason: str | None = None) -> list[Event]:
        """The reply played out (completed) or was cut short (cancelled: `spoken` is what was heard)."""
        response = self.responses.get(turn_index)
        if response is None or response.status != "in_progress":
            return []
        response.status, response.reason = status, reason
        item = response.item
        full = "".join(response.text).strip()
        if not item.truncated:
            item.text = full if spoken is None else spoken
        item.status = "completed" if status == "completed" else "incomplete"
        where = self._where(response)
        if response.modalities == ("text",):
            events = [self.event("response.output_text.done", text=item.text, **where)]
            part = {"type": "text", "text": item.text}
        else:
            events = [
                self.event("response.output_audio.done", **where),
                self.event("response.output_audio_transcript.done", transcript=item.text, **where),
            ]
            part = {"type": "audio", "transcript": item.text}
        return [
            *events,
            self.event("response.content_part.done", part=part, **where),
            self.event("response.output_item.done", response_id=response.id, output_index=0, item=item.describe()),
            self.item_done(item),
        ]

    def done(self, turn_index: int, metrics: dict[str, Any]) -> list[Event]:
        """The turn's metrics close its response: response.done with the usage."""
        response = self.responses.get(turn_index)
        if response is None:
            return []
        if response.status == "in_progress":  # ended without reply_done or interrupted (a failed stage)
            events = self.finish(turn_index, "failed", spoken="")
        else:
            events = []
        prompt, cached = int(metrics.get("prompt_tokens", 0)), int(metrics.get("cached_prompt_tokens", 0))
        completion = int(metrics.get("completion_tokens", 0))
        usage = {
            "total_tokens": prompt + completion,
            "input_tokens": prompt,
            "output_tokens": completion,
            "input_token_details": {"cached_tokens": cached, "text_tokens": prompt, "audio_tokens": 0},
            "output_token_details": {"text_tokens": completion, "audio_tokens": 0},
        }
        return [*events, self.event("response.done", response={**self._describe(response), "usage": usage})]

    def cancel(self) -> Response | None:
        """response.cancel: the live response sends no more audio from now on."""
        response = self.active
        if response is not None:
            response.cancel_asked = True
        return response

    def truncate(self, item_id: object, content_index: object, audio_end_ms: object) -> tuple[Item, str]:
        """conversation.item.truncate: the assistant item and the text its listener heard by `audio_end_ms`."""
        item = self.items.get(item_id) if isinstance(item_id, str) else None
        if item is None or item.role != "assistant":
            raise RealtimeProblem(f"no assistant item {item_id!r} to truncate", "item_not_found", "item_id")
        if content_index != 0:
            raise RealtimeProblem("content_index must be 0 (an item has one content part)", param="content_index")
        if not isinstance(audio_end_ms, int) or isinstance(audio_end_ms, bool) or audio_end_ms < 0:
            raise RealtimeProblem("audio_end_ms must be a whole number of milliseconds", param="audio_end_ms")
        if audio_end_ms > item.audio_ms + 1:
            raise RealtimeProblem(
                f"audio_end_ms={audio_end_ms} is past the end of the item's audio ({item.audio_ms:.0f} ms sent)",
                param="audio_end_ms",
            )
        heard = item.heard(audio_end_ms)
        item.text, item.status, item.truncated = heard, "incomplete", True
        return item, heard

    def _where(self, response: Response) -> dict[str, Any]:
        return {"response_id": response.id, "item_id": response.item.id, "output_index": 0, "content_index": 0}

    def _describe(self, response: Response) -> Event:
        status_details: dict[str, Any] | None = None
        if response.status == "cancelled":
            status_details = {"type": "cancelled", "reason": response.reason}
        elif response.status == "failed":
            status_details = {"type": "failed", "error": {"type": "server_error", "code": "stage_failed"}}
        output = [] if response.status == "in_progress" else [response.item.describe()]
        return {
            "id": response.id,
            "object": "realtime.response",
            "status": response.status,
            "status_details": status_details,
            "output": output,
            "conversation_id": "conv_default",
            "output_modalities": list(response.modalities),
            "max_output_tokens": self.config.max_output_tokens or "inf",
            "audio": {"output": {"format": self.config.output_format.describe(), "voice": self.config.voice}},
            "usage": None,
            "metadata": None,
        }
