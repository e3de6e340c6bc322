"""The doors the fuzzer knocks on: how one case is sent to each, and what the door's answer counts as.

A door must answer every case with an acceptance or a clean refusal: a known gRPC status with a message a person can
act on, a WebSocket close with its code and reason (after an error event), an HTTP 4xx with a message. INTERNAL,
UNKNOWN, HTTP 5xx, an abnormal close or a dropped connection is a crash; a door that goes silent (no answer, no end)
for `Limits.hang_s` hangs; anything else (another code, an empty message, a broken protocol) is unexpected.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import grpc
from google.protobuf.message import Message
from hypothesis import strategies as st
from yarl import URL

from harness import strategies
from harness.strategies import OWN_ORIGIN, HttpCase, StreamCase, WsCase
from voicemesh.v1 import asr_pb2_grpc, conversation_pb2, conversation_pb2_grpc, llm_pb2, llm_pb2_grpc, tts_pb2_grpc


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    CLEAN_ERROR = "clean_error"
    CRASH = "crash"
    HANG = "hang"
    UNEXPECTED = "unexpected"


@dataclass(frozen=True)
class Outcome:
    """What a door made of one case, with a short description of its answer."""

    verdict: Verdict
    detail: str

    @property
    def bad(self) -> bool:
        return self.verdict in (Verdict.CRASH, Verdict.HANG, Verdict.UNEXPECTED)


@dataclass(frozen=True)
class Limits:
    """How long the fuzzer waits on a door."""

    hang_s: float = 10.0
    """A door silent this long (no answer, no end) after the client's last word hangs."""
    work_s: float = 20.0
    """A door still answering this long after the client's last word is working on it, not hung: the client cancels."""
    hold_s: float = 0.3
    """How long a client that ends by holding the stream open stays silent before it cancels."""
    write_gaps_s: tuple[float, ...] = (0.002, 0.025, 0.1)
    """Pauses between a streaming client's writes: the first, then the retries when the status was lost (below)."""


class Door(Protocol):
    """One door: its cases and how to send one."""

    name: str

    def cases(self) -> st.SearchStrategy[Any]: ...

    async def run(self, case: Any) -> Outcome: ...


# ---- gRPC ---------------------------------------------------------------------------------------------------------
CLEAN_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.NOT_FOUND,
    }
)
CRASH_CODES = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED}
)
LOST_STATUS = "Internal error from Core"
"""What grpcio reports, instead of the server's status, to a client that writes into a call the server has just
ended (grpc/grpc#36066): the door answered, the client library lost it. Such a case is sent again, slower."""


def grpc_outcome(code: grpc.StatusCode, details: str, events: int, cancelled: bool) -> Outcome:
    """The verdict on a call that ended with `code` after `events` responses (`cancelled`: by the client)."""
    if code == grpc.StatusCode.OK:
        return Outcome(Verdict.ACCEPTED, f"OK after {events} responses")
    if code == grpc.StatusCode.CANCELLED and cancelled:
        return Outcome(Verdict.ACCEPTED, f"cancelled by the client after {events} responses")
    described = f"{code.name}: {details[:160]!r}"
    if code in CLEAN_CODES and details.strip():
        return Outcome(Verdict.CLEAN_ERROR, described)
    if code in CRASH_CODES:
        return Outcome(Verdict.CRASH, described)
    return Outcome(Verdict.UNEXPECTED, described)


class Watch:
    """Reads a call's responses in a task, counting them, noting when the door last said anything and the first
    response `check` finds wrong."""

    def __init__(
        self,
        call: AsyncIterable[Any],
        check: Callable[[Message, int], Outcome | None] | None = None,
        stop_after: int = 0,
    ) -> None:
        self.responses = 0
        self.last_activity_s = time.monotonic()
        self.problem: Outcome | None = None
        self.enough = asyncio.Event()
        self._check = check
        self._stop_after = stop_after
        self.task = asyncio.ensure_future(self._read(call))

    async def _read(self, call: AsyncIterable[Any]) -> None:
        try:
            async for response in call:
                self.responses += 1
                self.touch()
                if self._check is not None and self.problem is None:
                    self.problem = self._check(response, self.responses)
                if self._stop_after and self.responses >= self._stop_after:
                    self.enough.set()
        except (grpc.aio.AioRpcError, asyncio.CancelledError):  # grpc raises CancelledError for a cancelled call
            pass  # the status is read from the call

    def touch(self) -> None:
        self.last_activity_s = time.monotonic()

    @property
    def ended(self) -> bool:
        return self.task.done()

    async def settle(self, limits: Limits) -> str:
        """Wait for the call to end: "ended", "hang" (silent for hang_s), "working" (still answering after work_s)
        or "enough" (stop_after responses came)."""
        started_s = time.monotonic()
        while not self.task.done():
            if self.enough.is_set():
                return "enough"
            await asyncio.wait({self.task}, timeout=0.05)
            now_s = time.monotonic()
            if now_s - self.last_activity_s > limits.hang_s:
                return "hang"
            if now_s - started_s > limits.work_s:
                return "working"
        return "ended"


async def _finish(call: Any, watch: Watch, state: str, limits: Limits, ending: str) -> Outcome | None:
    """Cancel a call that has not ended; the outcome if the case is decided without the status."""
    if state == "hang":
        call.cancel()
        return Outcome(Verdict.HANG, f"silent for {limits.hang_s:g} s after {watch.responses} responses ({ending})")
    if not watch.ended:
        call.cancel()
    await asyncio.gather(watch.task, return_exceptions=True)
    return watch.problem


class StreamDoor:
    """A bidirectional-streaming gRPC door (Converse, StreamingRecognize, StreamingSynthesize).

    `acknowledged`: the door answers its first message (Converse's SessionStarted), and a client writes on only
    after that answer, as the contract asks."""

    def __init__(
        self,
        name: str,
        open_call: Callable[[], Any],
        cases: Callable[[], st.SearchStrategy[StreamCase]],
        limits: Limits,
        acknowledged: bool = False,
        check: Callable[[Message, int], Outcome | None] | None = None,
    ) -> None:
        self.name = name
        self._open_call = open_call
        self._cases = cases
        self._limits = limits
        self._acknowledged = acknowledged
        self._check = check

    def cases(self) -> st.SearchStrategy[StreamCase]:
        return self._cases()

    async def run(self, case: StreamCase) -> Outcome:
        for gap_s in self._limits.write_gaps_s:
            outcome = await self._send(case, gap_s)
            if outcome.detail != f"INTERNAL: {LOST_STATUS!r}":
                return outcome
        return Outcome(
            Verdict.UNEXPECTED,
            f"INTERNAL {LOST_STATUS!r} even with {self._limits.write_gaps_s[-1]:g} s between writes: the door's "
            "status was lost (grpc/grpc#36066)",
        )

    async def _send(self, case: StreamCase, gap_s: float) -> Outcome:
        limits = self._limits
        call = self._open_call()
        watch = Watch(call, self._check)
        state = "ended"
        try:
            for index, request in enumerate(case.requests):
                if watch.ended:
                    break
                try:
                    await asyncio.wait_for(call.write(request), limits.hang_s)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    break  # the call is over; its status says why
                except TimeoutError:
                    state = "hang"
                    break
                watch.touch()
                if index == 0 and self._acknowledged:
                    while not (watch.responses or watch.ended):
                        await asyncio.sleep(0.002)
                        if time.monotonic() - watch.last_activity_s > limits.hang_s:
                            state = "hang"
                            break
                    if state == "hang":
                        break
                await asyncio.sleep(gap_s)
            if state != "hang" and not watch.ended:
                state = await self._end(call, watch, case.ending)
        finally:
            decided = await _finish(call, watch, state, limits, case.ending)
        if decided is not None:
            return decided
        return grpc_outcome(await call.code(), await call.details() or "", watch.responses, state != "ended")

    async def _end(self, call: Any, watch: Watch, ending: str) -> str:
        if ending == "half_close":
            await call.done_writing()
            watch.touch()
            return await watch.settle(self._limits)
        if ending == "hold":
            await asyncio.wait({watch.task}, timeout=self._limits.hold_s)
        # A refusal already on its way is read before the client cancels.
        await asyncio.wait({watch.task}, timeout=0.05)
        return "ended" if watch.ended else "cancel"


def check_converse_event(event: Message, index: int) -> Outcome | None:
    """Converse's own rules: SessionStarted comes first, and an error event names a known code and says why."""
    assert isinstance(event, conversation_pb2.ConverseEvent)
    kind = event.WhichOneof("event")
    if index == 1 and kind != "started":
        return Outcome(Verdict.UNEXPECTED, f"the first event was {kind}, not started")
    if kind != "error":
        return None
    error = event.error
    described = f"error event: stage {error.stage} {error.code}: {error.message[:160]!r}"
    if error.code in {code.name for code in CRASH_CODES}:
        return Outcome(Verdict.CRASH, described)
    if error.code not in {code.name for code in CLEAN_CODES} or not error.message.strip():
        return Outcome(Verdict.UNEXPECTED, described)
    return None


class GenerateDoor:
    """The LLM's Generate (one request, a stream of text). An accepted call is cancelled after a few responses: that
    frees the slot at once, and the fuzz is about the request."""

    name = "llm"
    RESPONSES = 4

    def __init__(self, channel: grpc.aio.Channel, limits: Limits) -> None:
        self._stub = llm_pb2_grpc.GeneratorStub(channel)
        self._limits = limits

    def cases(self) -> st.SearchStrategy[llm_pb2.GenerateRequest]:
        return strategies.generate_requests()

    async def run(self, case: llm_pb2.GenerateRequest) -> Outcome:
        call = self._stub.Generate(case)
        watch = Watch(call, stop_after=self.RESPONSES)
        state = "hang"
        try:
            state = await watch.settle(self._limits)
        finally:
            decided = await _finish(call, watch, state, self._limits, "read")
        if decided is not None:
            return decided
        return grpc_outcome(await call.code(), await call.details() or "", watch.responses, state != "ended")


# ---- browser doors ------------------------------------------------------------------------------------------------
WS_REFUSALS = frozenset({4400, 4401, 4403, 4408, 4409, 4429})
"""The gateway's own close codes (gateway/protocol.py): each comes after an error event and with a reason."""
WS_TOO_BIG = 1009
"""aiohttp's own close of a message over the door's 64 KB limit, before the door sees it: no error event, no reason
text (the standard code is the reason; to write one the door would have to read messages of any size)."""


@dataclass
class WsTalk:
    """What came back on one WebSocket: the events, the close code and reason, and anything malformed."""

    events: list[Any]
    close: tuple[int | None, str] | None = None
    problem: Outcome | None = None


class WebSocketDoor:
    """/api/ws: a start message, then frames, control messages and garbage."""

    name = "websocket"

    def __init__(self, base_url: str, limits: Limits) -> None:
        self._url = f"{base_url}/api/ws"
        self._limits = limits

    def cases(self) -> st.SearchStrategy[WsCase]:
        return strategies.ws_cases()

    async def run(self, case: WsCase) -> Outcome:
        timeout = aiohttp.ClientWSTimeout(ws_receive=None, ws_close=self._limits.hang_s)
        async with aiohttp.ClientSession() as client:
            try:
                ws = await asyncio.wait_for(client.ws_connect(self._url, timeout=timeout), self._limits.hang_s)
            except aiohttp.WSServerHandshakeError as error:
                return http_outcome(error.status, error.message, ok_detail="")
            except TimeoutError:
                return Outcome(Verdict.HANG, "the WebSocket handshake got no answer")
            talk = WsTalk([])
            stopped = False
            try:
                for item in case.messages:
                    if not await self._send(ws, item, talk) or talk.close is not None:
                        break
                if talk.close is None:
                    if case.ending == "stop":
                        stopped = await self._send(ws, json.dumps({"type": "stop"}), talk)
                        await self._receive(ws, talk, until_close=True)
                    elif case.ending == "wait":
                        await self._receive(ws, talk, self._limits.hold_s)
            finally:
                if not ws.closed:
                    await ws.close()
            if talk.close is None and case.ending == "stop" and stopped:
                return Outcome(Verdict.HANG, f"no close within {self._limits.hang_s:g} s of the stop")
            if talk.close is None:
                if ws.close_code is None:
                    return Outcome(Verdict.HANG, f"the close got no answer within {self._limits.hang_s:g} s")
                return talk.problem or Outcome(
                    Verdict.ACCEPTED, f"open until the client closed ({len(talk.events)} events)"
                )
            return talk.problem or ws_outcome(*talk.close, talk.events, stopped)

    async def _send(self, ws: aiohttp.ClientWebSocketResponse, item: str | bytes, talk: WsTalk) -> bool:
        """Send one message and read what is waiting; False if it could not be sent (the door had closed)."""
        try:
            if isinstance(item, bytes):
                await ws.send_bytes(item)
            else:
                await ws.send_str(item)
        except (ConnectionError, aiohttp.ClientError, RuntimeError):
            await self._receive(ws, talk, until_close=True)
            return False
        await self._receive(ws, talk, self._limits.write_gaps_s[0])
        return True

    async def _receive(
        self, ws: aiohttp.ClientWebSocketResponse, talk: WsTalk, quiet_s: float = 0.0, until_close: bool = False
    ) -> None:
        """Read messages until the door closes, or (unless `until_close`) until it is quiet for `quiet_s`; a door
        silent for hang_s, or answering for longer than work_s, stops the reading too."""
        started_s = time.monotonic()
        wait_s = self._limits.hang_s if until_close else quiet_s
        while talk.close is None and time.monotonic() - started_s < self._limits.work_s:
            try:
                message = await ws.receive(timeout=wait_s)
            except TimeoutError:
                return
            if message.type == aiohttp.WSMsgType.TEXT:
                try:
                    talk.events.append(json.loads(message.data))
                except ValueError:
                    talk.problem = talk.problem or Outcome(
                        Verdict.UNEXPECTED, f"a text message is not JSON: {message.data[:80]!r}"
                    )
            elif message.type == aiohttp.WSMsgType.CLOSE:
                talk.close = (message.data, message.extra or "")
            elif message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.ERROR):
                talk.close = (ws.close_code, "")


def ws_outcome(code: int | None, reason: str, events: list[Any], stopped: bool) -> Outcome:
    """The verdict on a WebSocket the door closed with `code` and `reason`, after `events`."""
    errors = [event for event in events if isinstance(event, dict) and event.get("type") == "error"]
    described = f"close {code}: {reason[:120]!r}"
    if code == 1000 and stopped:
        return Outcome(Verdict.ACCEPTED, f"{described} after the stop ({len(events)} events)")
    if code in WS_REFUSALS:
        if reason.strip() and errors and errors[-1].get("message"):
            return Outcome(Verdict.CLEAN_ERROR, f"{described} after {errors[-1].get('code')}")
        return Outcome(Verdict.UNEXPECTED, f"{described} without a reason or an error event before it")
    if code == WS_TOO_BIG:
        return Outcome(Verdict.CLEAN_ERROR, f"{described} (message too big)")
    if code in (1006, 1011, None):
        return Outcome(Verdict.CRASH, described)
    return Outcome(Verdict.UNEXPECTED, described)


def http_outcome(status: int, text: str, ok_detail: str) -> Outcome:
    """The verdict on an HTTP answer: 200 (with `ok_detail` empty, else it says what was wrong with the 200), a 4xx
    with a message, 503 for a full gateway; any other 5xx is a crash."""
    message = text
    try:
        body = json.loads(text)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message", ""))
    except ValueError:
        pass
    described = f"HTTP {status}: {message[:160]!r}"
    if status == 200:
        return (
            Outcome(Verdict.UNEXPECTED, f"HTTP 200 but {ok_detail}")
            if ok_detail
            else Outcome(Verdict.ACCEPTED, "HTTP 200")
        )
    if 400 <= status < 500 or (status == 503 and "RESOURCE_EXHAUSTED" in text):
        verdict = Verdict.CLEAN_ERROR if message.strip() else Verdict.UNEXPECTED
        return Outcome(verdict, described)
    if status >= 500:
        return Outcome(Verdict.CRASH, described)
    return Outcome(Verdict.UNEXPECTED, described)


class HttpDoor:
    """An HTTP endpoint of the browser doors: /api/offer (WebRTC signalling) or /api/config."""

    def __init__(
        self,
        name: str,
        base_url: str,
        cases: Callable[[], st.SearchStrategy[HttpCase]],
        check_ok: Callable[[str], str],
        limits: Limits,
    ) -> None:
        self.name = name
        self._base_url = base_url
        self._cases = cases
        self._check_ok = check_ok
        self._limits = limits

    def cases(self) -> st.SearchStrategy[HttpCase]:
        return self._cases()

    async def run(self, case: HttpCase) -> Outcome:
        url = URL(self._base_url + case.path)
        headers = {name: self._base_url if value == OWN_ORIGIN else value for name, value in case.headers}
        try:
            async with aiohttp.ClientSession() as client, asyncio.timeout(self._limits.hang_s):
                async with client.request(
                    case.method, url, headers=headers, data=case.body, skip_auto_headers=["Content-Type"]
                ) as reply:
                    text = await reply.text(errors="replace")
                    status = reply.status
        except TimeoutError:
            return Outcome(Verdict.HANG, f"no answer within {self._limits.hang_s:g} s")
        except aiohttp.ClientResponseError as error:
            # An answer this client could not read to its end (aiohttp's 400 to a HEAD has a body): its status counts.
            return http_outcome(error.status, error.message, ok_detail="")
        except aiohttp.ClientError as error:
            return Outcome(Verdict.CRASH, f"no answer: {type(error).__name__}: {error}"[:200])
        ok_detail = self._check_ok(text) if status == 200 and case.method != "HEAD" else ""
        return http_outcome(status, text, ok_detail)


def check_answer(text: str) -> str:
    """What is wrong with an /api/offer 200 ("" if nothing): it carries an SDP answer and the session's id."""
    try:
        body = json.loads(text)
    except ValueError:
        return "the body is not JSON"
    if not (isinstance(body, dict) and body.get("type") == "answer" and "m=audio" in str(body.get("sdp"))):
        return f"no SDP answer in {text[:80]!r}"
    return "" if body.get("session_id") else "no session_id"


def check_config(text: str) -> str:
    """What is wrong with an /api/config 200 ("" if nothing)."""
    try:
        body = json.loads(text)
    except ValueError:
        return "the body is not JSON"
    missing = {"ice_servers", "frame_ms", "input_sample_rates_hz"} - set(body if isinstance(body, dict) else ())
    return f"the config lacks {sorted(missing)}" if missing else ""


# ---- all of them --------------------------------------------------------------------------------------------------
DOORS = ("converse", "asr", "llm", "tts", "websocket", "offer", "config")


def build_doors(
    channels: dict[str, grpc.aio.Channel], http_url: str, offer_sdp: str, limits: Limits
) -> dict[str, Door]:
    """Every door the targets have: the gRPC ones on `channels` (gateway, asr, llm, tts), the browser doors at
    `http_url` (none if empty). `offer_sdp` is a real offer the /api/offer cases start from."""
    converse = conversation_pb2_grpc.ConversationStub(channels["gateway"])
    recognizer = asr_pb2_grpc.RecognizerStub(channels["asr"])
    synthesizer = tts_pb2_grpc.SynthesizerStub(channels["tts"])
    doors: dict[str, Door] = {
        "converse": StreamDoor(
            "converse", converse.Converse, strategies.converse_cases, limits, True, check_converse_event
        ),
        "asr": StreamDoor("asr", recognizer.StreamingRecognize, strategies.recognize_cases, limits),
        "llm": GenerateDoor(channels["llm"], limits),
        "tts": StreamDoor("tts", synthesizer.StreamingSynthesize, strategies.synthesize_cases, limits),
    }
    if http_url:
        doors["websocket"] = WebSocketDoor(http_url, limits)
        doors["offer"] = HttpDoor("offer", http_url, lambda: strategies.offer_cases(offer_sdp), check_answer, limits)
        doors["config"] = HttpDoor("config", http_url, strategies.config_cases, check_config, limits)
    return doors
