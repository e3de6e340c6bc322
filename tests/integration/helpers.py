"""Helpers for tests that talk to real services."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

import grpc

from gateway.server import GatewayServer, GatewaySettings, build_server
from voicemesh.mesh import free_port


async def expect_error(call: AsyncIterator[object] | Awaitable[object], code: grpc.StatusCode, *words: str) -> str:
    """Drain a streaming call (or await a unary one); assert it ends with `code` and a message containing `words`."""
    try:
        if isinstance(call, Awaitable) and not hasattr(call, "__aiter__"):
            await call
        else:
            async for _ in call:  # type: ignore[union-attr]
                pass
    except grpc.aio.AioRpcError as error:
        assert error.code() == code, f"expected {code.name}, got {error.code().name}: {error.details()}"
        for word in words:
            assert word in error.details(), f"{word!r} not in {error.details()!r}"
        return error.details()
    raise AssertionError(f"call ended without the expected {code.name}")


async def requests(*messages: object, hold: bool = False) -> AsyncIterator[object]:
    """Send `messages`; with `hold`, keep the stream open a while afterwards (the server ends the call)."""
    for message in messages:
        yield message
    if hold:
        await asyncio.sleep(5)  # long enough for the server to end the call; short enough to leave no pending task


async def requests_from(messages: Iterable[object]) -> AsyncIterator[object]:
    for message in messages:
        yield message


async def start_gateway(asr: str, llm: str, tts: str, **settings: Any) -> GatewayServer:
    """A gateway in this process on free ports (its browser doors too, unless http_port=-1)."""
    settings = {"drain_grace_s": 1, **settings}
    server = build_server(GatewaySettings(port=0, asr_target=asr, llm_target=llm, tts_target=tts, **settings))
    await server.start()
    return server


async def start_offline_gateway(**settings: Any) -> GatewayServer:
    """A gateway whose backends are not running: sessions open and wait for them, which the limits never need."""
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    return await start_gateway(*dead, **settings)
