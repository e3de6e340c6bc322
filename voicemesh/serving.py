"""The one way a voicemesh process serves gRPC: health, reflection, size limits, errors, graceful drain."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from voicemesh import logs, telemetry
from voicemesh.config import ServerSettings
from voicemesh.errors import RequestError

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


class Server:
    """A gRPC aio server that reports NOT_SERVING until `load` finishes and drains on SIGTERM."""

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
        self.port = 0

    async def start(self) -> int:
        limit = self.settings.max_message_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
                *KEEPALIVE_OPTIONS,
            ]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self._register(server)
        reflection.enable_server_reflection([*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        self.port = server.add_insecure_port(f"{self.settings.host}:{self.settings.port}")
        if self.port == 0:
            raise SystemExit(f"cannot bind {self.settings.host}:{self.settings.port}")
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        log.info("listening", extra={"address": f"{self.settings.host}:{self.port}"})
        if self._load is not None:
            await self._load()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"services": self.service_names})
        return self.port

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
    on the queue. An exception in the reader (bad input) is raised here so the call ends with its status.
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
            yield event
    finally:
        reader_task.cancel()


def run(service: str, settings: ServerSettings, build: Callable[[Any], Server]) -> None:
    """A service's main: structured logs, telemetry, serve until SIGTERM, drain, flush spans."""
    logs.configure(settings.log_level, service)
    telemetry.setup(service, "", settings.trace_file, settings.metrics_port, settings.host)
    try:
        asyncio.run(build(settings).run_until_signal())
    finally:
        telemetry.shutdown()
