"""Helpers for tests that talk to real services."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc


async def expect_error(call: AsyncIterator[object], code: grpc.StatusCode, *words: str) -> str:
    """Drain a streaming call; assert it ends with `code` and a message containing `words`."""
    try:
        async for _ in call:
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
