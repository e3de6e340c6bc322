"""A real browser on the gateway's page, for the browser tests (tests/e2e) and `python -m bench browser`: Debian
chromium driven by playwright, a WAV as its microphone, the page read through its state, and a loopback-only network.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import fcntl
import importlib.util
import json
import os
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from voicemesh.audio import Clip, float_to_pcm16, write_wav

CHROMIUM = Path("/usr/bin/chromium")
FED_RATE_HZ = 48000
SPEECH_RMS = 0.002  # 20 ms windows quieter than this at a clip's end are trimmed: the clip ends with the speech
CHROMIUM_ARGS = (
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--allow-loopback-in-peer-connection",
    "--autoplay-policy=no-user-gesture-required",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
NETNS_ENV = "VOICEMESH_NETNS"


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is absent: the project's setup installs Debian chromium (apt-get install -y chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is absent: the project's setup installs it (pip, the dev extra)"
    return None


def trimmed(clip: Clip) -> Clip:
    """The clip without its quiet tail, so the end of the clip is the end of the speech."""
    window = clip.rate_hz // 50
    samples = clip.samples
    end = len(samples)
    while end > window and np.sqrt(np.mean(samples[end - window : end] ** 2)) < SPEECH_RMS:
        end -= window
    return Clip(samples[:end], clip.rate_hz)


def fake_mic_wav(path: Path, parts: Sequence[Clip | float]) -> list[float]:
    """Write clips and seconds of digital silence as one 48 kHz WAV for chromium's fake microphone.

    Returns where each clip's speech ends, in seconds from the start of the file.
    """
    pieces: list[np.ndarray] = []
    ends: list[float] = []
    offset = 0
    for part in parts:
        if isinstance(part, Clip):
            samples = trimmed(part).to_rate(FED_RATE_HZ).samples
            ends.append((offset + len(samples)) / FED_RATE_HZ)
        else:
            samples = np.zeros(int(part * FED_RATE_HZ), np.float32)
        pieces.append(samples)
        offset += len(samples)
    write_wav(path, float_to_pcm16(np.concatenate(pieces)), FED_RATE_HZ)
    return ends


def chromium_args(wav: Path) -> list[str]:
    return [*CHROMIUM_ARGS, f"--use-file-for-fake-audio-capture={wav}"]


async def launch(playwright: Any, wav: Path) -> Any:
    """Headless chromium whose microphone plays `wav` (on a loop)."""
    return await playwright.chromium.launch(
        executable_path=str(CHROMIUM), headless=True, args=chromium_args(wav), chromium_sandbox=False
    )


def isolate_network() -> bool:
    """Move this (still single-threaded) process into a new network namespace with only loopback, up.

    Browser tests then cannot reach, or be reached from, anything but this machine's own test servers. Returns
    False, changing nothing, where namespaces are not allowed (no root, a container without CAP_SYS_ADMIN).
    """
    if os.environ.get(NETNS_ENV) == "1":
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet = 0x40000000
    if libc.unshare(clone_newnet) != 0:
        return False
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))
    os.environ[NETNS_ENV] = "1"  # for child processes and re-entry
    return True


def _story(state: dict[str, Any]) -> dict[str, Any]:
    """The page state a failure prints: every turn in a line (its metrics and hops left out, which made one turn
    ~1 KB and cut the story off after three turns), the interrupts, the errors and the last events."""
    turns = [
        {
            key: turn.get(key)
            for key in ("index", "user_text", "reply_text", "interrupted", "continued", "played_ms", "v2v_ms")
            if turn.get(key) is not None
        }
        for turn in state.get("turns", {}).values()
    ]
    events = state.get("events", [])
    return {
        **{k: v for k, v in state.items() if k not in ("events", "turns")},
        "turns": turns,
        "errors": [e for e in events if e.get("type") == "error"][-5:],
        "last_events": [e.get("type") for e in events][-20:],
    }


class PageDriver:
    """The gateway's page in a browser tab, read through its `window.voicemesh.state`."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.console: list[str] = []
        page.on("console", lambda message: self.console.append(f"{message.type}: {message.text}"))
        page.on("pageerror", lambda error: self.console.append(f"pageerror: {error}"))

    async def open(self, url: str) -> None:
        await self.page.goto(url)
        await self.page.click("#mic")

    async def state(self) -> dict[str, Any]:
        state: dict[str, Any] = await self.page.evaluate("JSON.parse(JSON.stringify(window.voicemesh.state))")
        return state

    async def wait_until(self, expression: str, timeout_s: float) -> dict[str, Any]:
        """Poll until `expression` (JavaScript over `s`, the page state) is true; AssertionError with the state."""
        # Evaluated in the page: copying the whole state out at every poll took ~0.1 core beside the mesh.
        check = f"() => {{ const s = window.voicemesh?.state; return Boolean(s && ({expression})); }}"
        deadline = time.monotonic() + timeout_s
        while True:
            if await self.page.evaluate(check):
                return await self.state()
            if time.monotonic() > deadline:
                state = await self.state()
                raise AssertionError(
                    f"page never reached `{expression}` in {timeout_s:.0f} s: {json.dumps(_story(state))}\n"
                    + "\n".join(self.console[-20:])
                )
            await asyncio.sleep(0.1)


# A microphone the test plays into, instead of chromium's fake device (a WAV on a loop, from when the page opened
# it): `getUserMedia` returns a Web Audio stream that is silent until `window.voicemesh_mic.play(name)`, or
# `playWhen(name, expression, delayMs)`, which plays the clip `delayMs` after `expression` (JavaScript over `s`,
# the page state) first holds, polled every 5 ms in the page. A clip is fed once, at a moment the page's own state
# defines: a scenario with one take. The processing a real microphone gets (echo cancellation, noise suppression,
# gain control) does not apply to such a stream: the clip reaches the page as it is.
SCRIPTED_MIC = """
(() => {
  const clips = {};
  const mic = { ready: false, played: [] };
  let micCtx = null;
  let micOut = null;
  navigator.mediaDevices.getUserMedia = async () => {
    micCtx = new AudioContext({ sampleRate: FED_RATE_HZ });
    await micCtx.resume();
    micOut = micCtx.createMediaStreamDestination();
    // A source that never ends, at 1 LSB: between clips the track goes on carrying (near) silence, as a device's
    // does. With no source playing, the WebRTC track sent nothing after the question, and the turn never ended.
    const floor = micCtx.createConstantSource();
    floor.offset.value = 1 / 32768;
    floor.connect(micOut);
    floor.start();
    mic.ready = true;
    return micOut.stream;
  };
  mic.load = (name, base64) => {
    const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
    const pcm = new Int16Array(bytes.buffer);
    clips[name] = Float32Array.from(pcm, (v) => v / 32768);
  };
  mic.play = (name) => {
    const samples = clips[name];
    const buffer = micCtx.createBuffer(1, samples.length, FED_RATE_HZ);
    buffer.copyToChannel(samples, 0);
    const source = micCtx.createBufferSource();
    source.buffer = buffer;
    source.connect(micOut);
    source.start();
    mic.played.push({ name, at_ms: Date.now() });
  };
  mic.playWhen = (name, expression, delayMs) => {
    const holds = new Function("s", `return Boolean(${expression});`);
    const poll = setInterval(() => {
      const s = window.voicemesh && window.voicemesh.state;
      if (!s || !holds(s)) return;
      clearInterval(poll);
      setTimeout(() => mic.play(name), delayMs);
    }, 5);
  };
  window.voicemesh_mic = mic;
})();
""".replace("FED_RATE_HZ", str(FED_RATE_HZ))


async def load_into_mic(page: Any, name: str, clip: Clip) -> None:
    """Hand `clip` (its speech, without the quiet either side) to the page's SCRIPTED_MIC as `name`."""
    samples = trimmed(clip).to_rate(FED_RATE_HZ).samples
    window = FED_RATE_HZ // 50
    start = 0
    while start + window < len(samples) and np.sqrt(np.mean(samples[start : start + window] ** 2)) < SPEECH_RMS:
        start += window
    data = base64.b64encode(float_to_pcm16(samples[start:])).decode("ascii")
    await page.evaluate("([name, data]) => window.voicemesh_mic.load(name, data)", [name, data])
