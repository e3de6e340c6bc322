"""The one way a voicemesh process serves gRPC: health, reflection, size limits, errors, credentials, TLS,
graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from voicemesh import logs, telemetry
from voicemesh.auth import Authenticator, Unauthenticated
from voicemesh.config import ServerSettings
from voicemesh.errors import RequestError
from voicemesh.tls import ServerTls

log = logging.getLogger(__name__)

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


def stream_handler(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """Wrap a streaming servicer method: RequestError -> its status; anything else -> INTERNAL, logged."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            async for item in method(self, request, context):
                yield item
        except RequestError as exc:
            log.info("request refused", extra={"rpc": method.__name__, "code": exc.code.name, "reason": exc.message})
            telemetry.ERRORS.labels(method.__name__, exc.code.name).inc()
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("stream failed", extra={"rpc": method.__name__})
            telemetry.ERRORS.labels(method.__name__, "INTERNAL").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed inside the server; see its logs")

    return wrapper


HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFUSAL_DRAIN_S = 2.0


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


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health checks needs a valid credential; a refusal is a bare UNAUTHENTICATED, counted and
    logged with its reason (never the credential)."""

    def __init__(self, authenticator: Authenticator, door: str) -> None:
        self._authenticator = authenticator
        self._door = door

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if details.method.startswith(HEALTH_PREFIX) or handler is None:
            return handler
        metadata = {key: value for key, value in details.invocation_metadata or () if isinstance(value, str)}
        try:
            self._authenticator.verify(metadata.get("authorization", ""))
        except Unauthenticated as refused:
            telemetry.UNAUTHENTICATED.labels(self._door).inc()
            log.info("unauthenticated", extra={"rpc": details.method, "reason": str(refused)})
            return _refusal(handler)
        return handler


def _refusal(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED and no detail.

    A streaming caller's messages are read (for at most REFUSAL_DRAIN_S) before the refusal: a client that is
    still writing when the call ends sees INTERNAL "Internal error from Core" instead of the status
    (grpc/grpc#36066)."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")

    async def drain_then_refuse(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REFUSAL_DRAIN_S):
                async for _ in requests:
                    pass
        await refuse(None, context)

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(drain_then_refuse, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(drain_then_refuse, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    return grpc.unary_unary_rpc_method_handler(refuse, **serializers)


class Server:
    """A gRPC aio server that reports NOT_SERVING until `load` finishes and drains on SIGTERM.

    With TLS settings it serves TLS (mutual with a client CA); with a token or JWT keys, every call but the health
    check needs a credential; `health_port` adds a plaintext port with only the health service, for probes."""

    def __init__(
        self,
        settings: ServerSettings,
        service_names: Sequence[str],
        register: Callable[[grpc.aio.Server], None],
        load: Callable[[], Awaitable[None]] | None = None,
        servicer: object = None,
        unload: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.servicer = servicer  # for in-process tests and embedding
        self.service_names = list(service_names)
        self._register = register
        self._load = load
        self._unload = unload  # after the drain: engines and channels closed in order, not by the interpreter's exit
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.port = 0
        self.health_port = 0

    async def start(self) -> int:
        limit = self.settings.max_message_bytes
        authenticator = authenticator_for(self.settings)
        name = self.service_names[0].rpartition(".")[2].lower() if self.service_names else "grpc"
        server = grpc.aio.server(
            interceptors=[AuthInterceptor(authenticator, name)] if authenticator.enabled else None,
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
        await self._health.enter_graceful_shutdown()

    async def _set_all(self, status: int) -> None:
        for name in ["", *self.service_names]:
            await self._health.set(name, status)

    async def stop(self) -> None:
        """Stop accepting new calls and give in-flight ones `drain_grace_s` to finish."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        log.info("draining", extra={"grace_s": self.settings.drain_grace_s})
        await self._server.stop(self.settings.drain_grace_s)
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
        await self.start()
        await stop.wait()
        await self.stop()


async def merge_reader(reader: Awaitable[None], events: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    """Yield `events` until a None arrives, while `reader` consumes the client's requests.

    The bidirectional pattern of every service: a task reads requests and feeds engines, which put events
    on the queue. An exception in the reader (bad input) is raised here so the call ends with its status, and so
    is an exception a background task puts on the queue (an engine that failed): the call never goes silent.
    """
    reader_task = asyncio.ensure_future(reader)
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
