"""The one way a voicemesh process serves gRPC: health, reflection, size limits, errors, credentials, TLS,
graceful drain."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import grpc
import threadpoolctl
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from voicemesh import logs, telemetry
from voicemesh.auth import Authenticator, Unauthenticated
from voicemesh.config import ServerSettings
from voicemesh.errors import RequestError
from voicemesh.tls import ServerTls

log = logging.getLogger(__name__)

REFUSED_WHILE_DRAINING = "draining; use another replica"
ENDED_BY_DRAIN = "server draining; reconnect to another replica"
END_GRACE_S = 1.0  # after the drain: time for the calls it ended to send their status before the server stops

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]


def channel_options(max_message_bytes: int = 4 * 1024 * 1024) -> list[tuple[str, Any]]:
    """Options for long-lived client channels (keepalive so a dead peer is noticed, size limits)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        # Reconnect quickly after a backend restart instead of backing off for tens of seconds.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def health_check(
    channel: grpc.aio.Channel,
) -> grpc.aio.UnaryUnaryMultiCallable[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]:
    """The standard grpc.health.v1 `Check` call on `channel` (typed: the health package's own stub is not)."""
    return channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )


class Draining(RequestError):
    """A call refused or ended because its server is draining: UNAVAILABLE, so the client goes to another replica."""

    def __init__(self, message: str = ENDED_BY_DRAIN) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


async def _abort(
    method: str, context: grpc.aio.ServicerContext[Any, Any], error: Exception, caller: AsyncIterator[Any] | None = None
) -> None:
    """Answer a handler's failure: RequestError -> its status; anything else -> INTERNAL, logged. `caller`: the
    call's request stream, if the caller streams (the status then waits for a pause in its writing: `refuse`)."""
    if isinstance(error, Draining):  # the server's own doing, not the caller's error: logged, not counted
        log.info("drained", extra={"rpc": method, "reason": error.message})
        await refuse(context, error.code, error.message, caller)
    if isinstance(error, RequestError):
        log.info("request refused", extra={"rpc": method, "code": error.code.name, "reason": error.message})
        telemetry.ERRORS.labels(method, error.code.name).inc()
        await refuse(context, error.code, error.message, caller)
    log.error("call failed", exc_info=error, extra={"rpc": method})
    telemetry.ERRORS.labels(method, "INTERNAL").inc()
    await refuse(context, grpc.StatusCode.INTERNAL, f"{method} failed inside the server; see its logs", caller)


def stream_handler(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """Wrap a streaming servicer method: RequestError -> its status; anything else -> INTERNAL, logged. A streamed
    request reaches the method as a CallerStream, so that a refusal can read the caller's writing to a pause."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        caller = CallerStream(request) if isinstance(request, AsyncIterator) else None
        telemetry.CALLS.labels(method.__name__).inc()
        try:
            async for item in method(self, request if caller is None else caller, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:
            await _abort(method.__name__, context, error, caller)
        finally:
            if caller is not None:
                caller.close()

    return wrapper


def unary_handler(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Wrap a unary servicer method as `stream_handler` does."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        telemetry.CALLS.labels(method.__name__).inc()
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:
            await _abort(method.__name__, context, error)

    return wrapper


HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFUSAL_DRAIN_S = 2.0  # the longest a refusal reads the caller's messages
# When a refusal is sent, so that the caller is not writing (grpc/grpc#36066): once it has sent nothing for
# REFUSAL_QUIET_S (the end of a burst: a replay, a flood), or just after a message when the last three came at least
# REFUSAL_PACE_S after the one before (a paced caller: its next frame is ~20 ms away). A client whose loop stalls
# longer than REFUSAL_QUIET_S mid-burst can still see INTERNAL; with 5 ms, one in the same process as the gateway did.
REFUSAL_QUIET_S = 0.05
REFUSAL_PACE_S = 0.015  # a burst on a loaded machine had gaps of up to 10 ms

T = TypeVar("T")


class CallerStream(Generic[T]):
    """A streaming call's requests, each read in a task of its own: a reader cancelled mid-read (its call ended for
    another reason) leaves that read pending instead of losing it, so the stream can still be read to a pause."""

    def __init__(self, requests: AsyncIterator[T]) -> None:
        self._requests = requests
        self._next: asyncio.Future[T] | None = None
        self._readers = 0
        self._closed = False

    def __aiter__(self) -> CallerStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._next is None:
            self._next = asyncio.ensure_future(self._read())
            self._next.add_done_callback(_retrieve)
        self._readers += 1
        try:
            request = await asyncio.shield(self._next)
        finally:
            self._readers -= 1
            if self._closed and not self._readers:
                self._next.cancel()
        self._next = None
        return request

    async def _read(self) -> T:
        return await anext(self._requests)

    def close(self) -> None:
        """No more reads: the one pending is cancelled once no one waits for it (a refusal may still be reading)."""
        self._closed = True
        if self._next is not None and not self._readers:
            self._next.cancel()


def _retrieve(read: asyncio.Future[Any]) -> None:
    if not read.cancelled():
        read.exception()  # the call's end, seen by no reader: not an error to log


async def until_caller_pauses(requests: AsyncIterator[Any], quiet_s: float, limit_s: float = REFUSAL_DRAIN_S) -> None:
    """Read and drop the caller's messages until it half-closes, sends nothing for `quiet_s`, writes at a pace (three
    gaps of REFUSAL_PACE_S in a row: return just after a message), or `limit_s` is over (just after a message): a
    client still writing when its call ends sees INTERNAL "Internal error from Core" instead of the status
    (grpc/grpc#36066)."""
    loop = asyncio.get_running_loop()
    last_s = loop.time()
    deadline_s = last_s + limit_s
    paced = 0  # gaps of REFUSAL_PACE_S or more in a row
    with contextlib.suppress(Exception):  # whatever ends the reading (an end, a pause, a broken call), the status goes
        while paced < 3 and last_s < deadline_s:
            async with asyncio.timeout(min(quiet_s, deadline_s - last_s)):
                await anext(requests)
            now_s = loop.time()
            paced = paced + 1 if now_s - last_s >= REFUSAL_PACE_S else 0
            last_s = now_s


async def refuse(
    context: grpc.aio.ServicerContext[Any, Any],
    code: grpc.StatusCode,
    message: str,
    caller: AsyncIterator[Any] | None = None,
    quiet_s: float = REFUSAL_QUIET_S,
) -> None:
    """End the call with `code` and `message` (raises AbortError, as context.abort does); a caller that streams its
    requests is read to a pause first (`until_caller_pauses`), so that it sees the status and not INTERNAL."""
    if caller is not None:
        await until_caller_pauses(caller, quiet_s)
    await context.abort(code, message)


def authenticator_for(settings: ServerSettings) -> Authenticator:
    return Authenticator(settings.auth_token, settings.jwt_keys, settings.jwt_audience)


def server_tls(settings: ServerSettings) -> ServerTls | None:
    if not (settings.tls_cert or settings.tls_key):
        if settings.tls_client_ca:
            raise SystemExit("tls_client_ca needs tls_cert and tls_key: mutual TLS is TLS first")
        return None
    if not (settings.tls_cert and settings.tls_key):
        raise SystemExit("TLS needs both tls_cert and tls_key")
    return ServerTls(settings.tls_cert, settings.tls_key, settings.tls_client_ca)


class _Gate(grpc.aio.ServerInterceptor):
    """Every call but a health check passes `refusal`; one it refuses gets a handler of the call's shape that ends
    the call with the refusal's status, at the first pause in the caller's messages."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        refused = self.refusal(details)
        return handler if refused is None else _refusal(handler, *refused)

    @abc.abstractmethod
    def refusal(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str, float] | None:
        """(status, message, quiet seconds before it is sent) for a call to refuse; None lets it through."""


class AuthInterceptor(_Gate):
    """Every call but health checks needs a valid credential; a refusal is a bare UNAUTHENTICATED, counted and
    logged with its reason (never the credential)."""

    def __init__(self, authenticator: Authenticator, door: str) -> None:
        self._authenticator = authenticator
        self._door = door

    def refusal(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str, float] | None:
        metadata = {key: value for key, value in details.invocation_metadata or () if isinstance(value, str)}
        try:
            self._authenticator.verify(metadata.get("authorization", ""))
        except Unauthenticated as refused:
            telemetry.UNAUTHENTICATED.labels(self._door).inc()
            log.info("unauthenticated", extra={"rpc": details.method, "reason": str(refused)})
            return grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", REFUSAL_DRAIN_S
        return None


class DrainInterceptor(_Gate):
    """Once `refusing` is set (the server drains), every new call but a health check is refused with UNAVAILABLE,
    at the first pause in the caller's messages (within milliseconds), so that it goes elsewhere without waiting."""

    def __init__(self) -> None:
        self.refusing = False

    def refusal(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str, float] | None:
        if not self.refusing:
            return None
        log.info("refused while draining", extra={"rpc": details.method})
        return grpc.StatusCode.UNAVAILABLE, REFUSED_WHILE_DRAINING, REFUSAL_QUIET_S


def _refusal(
    handler: grpc.RpcMethodHandler[Any, Any], code: grpc.StatusCode, details: str, quiet_s: float
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as `handler` that ends the call with `code` and `details`.

    A streaming caller's messages are read first, and the refusal comes when it half-closes, has sent nothing for
    `quiet_s`, or just after a message once REFUSAL_DRAIN_S is over: not while it is writing, for a client still
    writing when the call ends sees INTERNAL "Internal error from Core" instead of the status (grpc/grpc#36066)."""

    async def refuse_at_once(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, details)

    async def drain_then_refuse(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await refuse(context, code, details, aiter(requests), quiet_s)

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(drain_then_refuse, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(drain_then_refuse, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_at_once, **serializers)
    return grpc.unary_unary_rpc_method_handler(refuse_at_once, **serializers)


class DrainableCall(Protocol):
    """An open streaming call, as the drain sees it."""

    async def wind_down(self) -> None:
        """Take no new work; return once the work in flight is done and its last event queued."""

    def end(self) -> None:
        """End the call now, after the events already queued, with Draining (unless it is ending by itself)."""


class OpenCalls:
    """A servicer's open calls, for its drain: each finishes the work it has in flight and then ends with
    UNAVAILABLE, so that its client reconnects to another replica; new calls are refused."""

    def __init__(self) -> None:
        self.draining = False
        self._open: dict[object, DrainableCall | None] = {}
        self._none_open = asyncio.Event()
        self._none_open.set()

    @contextlib.contextmanager
    def hold(self, call: DrainableCall | None = None) -> Iterator[None]:
        """Count a call as open for the block; once the drain has begun, raise Draining instead. A call held
        without a DrainableCall (one reply, however streamed) is waited for, never ended early."""
        if self.draining:
            raise Draining(REFUSED_WHILE_DRAINING)
        key = object()
        self._open[key] = call
        self._none_open.clear()
        try:
            yield
        finally:
            del self._open[key]
            if not self._open:
                self._none_open.set()

    async def drain(self) -> None:
        """Refuse new calls, let each open call finish its work in flight and end it, and return once none is open.

        Cancelled (the grace is over), it ends at once each call it has not ended yet."""
        self.draining = True
        waiting = [call for call in self._open.values() if call is not None]

        async def finish(call: DrainableCall) -> None:
            await call.wind_down()
            waiting.remove(call)
            call.end()

        try:
            async with asyncio.TaskGroup() as group:
                for call in list(waiting):
                    group.create_task(finish(call))
            await self._none_open.wait()
        finally:
            for call in waiting:
                call.end()


class Server:
    """A gRPC aio server that reports NOT_SERVING until `load` finishes and drains on SIGTERM.

    With TLS settings it serves TLS (mutual with a client CA); with a token or JWT keys, every call but the health
    check needs a credential; `health_port` adds a plaintext port with only the health service, for probes.
    `drain` (typically an OpenCalls' drain) lets the calls in flight finish their work before the server stops."""

    def __init__(
        self,
        settings: ServerSettings,
        service_names: Sequence[str],
        register: Callable[[grpc.aio.Server], None],
        load: Callable[[], Awaitable[None]] | None = None,
        servicer: object = None,
        unload: Callable[[], Awaitable[None]] | None = None,
        drain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.servicer = servicer  # for in-process tests and embedding
        self.service_names = list(service_names)
        self._register = register
        self._load = load
        self._unload = unload  # after the drain: engines and channels closed in order, not by the interpreter's exit
        self._drain = drain
        self._gate = DrainInterceptor()
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.port = 0
        self.health_port = 0

    async def start(self) -> int:
        limit = self.settings.max_message_bytes
        authenticator = authenticator_for(self.settings)
        name = self.service_names[0].rpartition(".")[2].lower() if self.service_names else "grpc"
        interceptors: list[grpc.aio.ServerInterceptor] = [self._gate]
        if authenticator.enabled:  # outermost: a caller without a credential learns nothing, not even of a drain
            interceptors.insert(0, AuthInterceptor(authenticator, name))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
                *KEEPALIVE_OPTIONS,
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self._register(server)
        reflection.enable_server_reflection([*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        address = f"{self.settings.host}:{self.settings.port}"
        tls = server_tls(self.settings)
        self.port = (
            server.add_secure_port(address, tls.grpc_credentials()) if tls else server.add_insecure_port(address)
        )
        if self.port == 0:
            raise SystemExit(f"cannot bind {address}")
        if self.settings.health_port:
            self._health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            self.health_port = self._health_server.add_insecure_port(
                f"{self.settings.host}:{self.settings.health_port}"
            )
            if self.health_port == 0:
                raise SystemExit(f"cannot bind the health port {self.settings.host}:{self.settings.health_port}")
            await self._health_server.start()
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        log.info(
            "listening",
            extra={
                "address": f"{self.settings.host}:{self.port}",
                "tls": "mutual" if tls and tls.client_ca_file else bool(tls),
                "auth": authenticator.enabled,
                "health_port": self.health_port or None,
            },
        )
        if self._load is not None:
            await self._load()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"services": self.service_names})
        return self.port

    async def set_not_serving(self) -> None:
        """Tell health checkers (a load balancer, the kubelet) to send no new work here."""
        telemetry.SERVING.set(0)
        await self._health.enter_graceful_shutdown()

    async def _set_all(self, status: int) -> None:
        telemetry.SERVING.set(1 if status == health_pb2.HealthCheckResponse.SERVING else 0)
        for name in ["", *self.service_names]:
            await self._health.set(name, status)

    async def stop(self) -> None:
        """Drain, then stop: new calls are refused with UNAVAILABLE and health says NOT_SERVING at once; `drain`
        lets the calls in flight finish their work and ends them; past `drain_grace_s` whatever is open is cut."""
        if self._server is None:
            return
        self._gate.refusing = True  # first: a client that has seen NOT_SERVING is refused from then on
        telemetry.SERVING.set(0)
        await self._health.enter_graceful_shutdown()
        grace_s = self.settings.drain_grace_s
        deadline_s = time.monotonic() + grace_s
        log.info("draining", extra={"grace_s": grace_s})
        if self._drain is None:
            await self._server.stop(grace_s)
        else:
            try:
                async with asyncio.timeout(grace_s):
                    await self._drain()
            except TimeoutError:
                log.warning("calls still busy at the end of the drain; ended", extra={"grace_s": grace_s})
            except Exception:
                log.exception("drain failed; stopping anyway")
            # What the drain ended gets END_GRACE_S to send its status; calls it does not know of (a health watch, a
            # stream before its first message) keep the rest of the grace.
            await self._server.stop(max(deadline_s - time.monotonic(), END_GRACE_S))
        self._server = None
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None
        if self._unload is not None:
            await self._unload()
        log.info("stopped")

    async def run_until_signal(self) -> None:
        """Start, then serve until SIGTERM or SIGINT, then drain."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        one_blas_thread()
        await self.start()
        # What is loaded by now lives as long as the process: out of the collector's reach, so that no full collection
        # walks it again. One did, in the gateway, for 50-55 ms on a loaded box (13.5 ms idle) while its event loop
        # stood still: a reply's WebRTC packets came late and the browser filled the gap with invented audio.
        gc.collect()
        gc.freeze()
        await stop.wait()
        await self.stop()


def one_blas_thread() -> None:
    """numpy's matrix products on the calling process's own thread only (every service does this as it starts serving).

    OpenBLAS keeps a thread per core and spins it after each call, waiting for the next. In the ASR (Whisper's mel
    filterbank is a matrix product, once per decode) that thread burned 2 s of a core per 7 s of speech, at nice 0,
    in the very moments the LLM's prefill needed both cores: bench.pipeline (c) V2V p50 354 -> 300 ms, the LLM's
    first token 83 -> 43 ms. No service's numpy work is big enough to be worth sharing out."""
    threadpoolctl.threadpool_limits(1, user_api="blas")


async def merge_reader(reader: Awaitable[None], events: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    """Yield `events` until a None arrives, while `reader` consumes the client's requests.

    The bidirectional pattern of every service: a task reads requests and feeds engines, which put events
    on the queue. An exception in the reader (bad input) is raised here so the call ends with its status, and so
    is an exception a background task puts on the queue (an engine that failed): the call never goes silent.
    """
    reader_task = asyncio.ensure_future(reader)
    getter: asyncio.Future[Any] | None = None
    try:
        while True:
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, reader_task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                reader_task.result()  # raises the reader's error; returns None if it just finished
                event = await events.get()
            else:
                event = getter.result()
            if event is None:
                return
            if isinstance(event, BaseException):
                raise event
            yield event
    finally:
        reader_task.cancel()
        if getter is not None:
            getter.cancel()  # a call cancelled mid-wait leaves no get() pending


def run(service: str, settings: ServerSettings, build: Callable[[Any], Server]) -> None:
    """A service's main: structured logs, telemetry, serve until SIGTERM, drain, flush spans."""
    logs.configure(settings.log_level, service)
    authenticator = authenticator_for(settings)
    telemetry.setup(
        service,
        "",
        settings.trace_file,
        settings.metrics_port,
        settings.host,
        metrics_authorized=authenticator.accepts if authenticator.enabled else None,
    )
    try:
        asyncio.run(build(settings).run_until_signal())
    finally:
        telemetry.shutdown()
