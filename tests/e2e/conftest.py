"""Browser fixtures: chromium driven by playwright, a WAV as its microphone, the gateway's page on loopback."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from gateway.server import GatewayServer, GatewaySettings, build_server
from harness.browser import PageDriver, browser_missing, fake_mic_wav, launch
from tests.conftest import free_port
from voicemesh.audio import Clip


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def playwright():
    reason = browser_missing()
    if reason:
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    driver = await async_playwright().start()
    yield driver
    await driver.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def web_gateway(playwright, services: dict[str, str]) -> AsyncIterator[GatewayServer]:
    """The gateway with its browser doors on free loopback ports, over the real ASR, LLM and TTS processes."""
    settings = GatewaySettings(
        port=0, asr_target=services["asr"], llm_target=services["llm"], tts_target=services["tts"], drain_grace_s=1
    )
    server = build_server(settings)
    await server.start()
    yield server
    await server.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def offline_gateway(playwright) -> AsyncIterator[GatewayServer]:
    """A gateway serving the page whose backends are not running (for what needs no conversation)."""
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    server = build_server(GatewaySettings(port=0, asr_target=dead[0], llm_target=dead[1], tts_target=dead[2]))
    await server.start()
    yield server
    await server.stop()


@contextlib.asynccontextmanager
async def page_talking(
    playwright,
    server: GatewayServer,
    microphone: Sequence[Clip | float],
    query: str = "",
    press_mic: bool = True,
    init_script: str = "",
) -> AsyncIterator[PageDriver]:
    """The gateway's page in a fresh chromium whose microphone plays `microphone` (on a loop), mic button pressed;
    `init_script` runs in the page before its own scripts."""
    with tempfile.TemporaryDirectory(prefix="voicemesh-e2e-") as workdir:
        wav = Path(workdir) / "microphone.wav"
        fake_mic_wav(wav, microphone)
        browser = await launch(playwright, wav)
        try:
            driver = PageDriver(await browser.new_page())
            if init_script:
                await driver.page.add_init_script(init_script)
            await driver.page.goto(f"http://localhost:{server.http_port}/{query}")
            if press_mic:
                await driver.page.click("#mic")
            yield driver
        finally:
            await browser.close()
