"""`voicemesh up` as a person runs it (`make run`), on a terminal: TLS on every hop with --tls, one line per turn,
and SIGTERM from a supervisor stops every child process."""

from __future__ import annotations

import asyncio
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import load_clip
from voicemesh.clients import Credentials
from voicemesh.conversation import talk
from voicemesh.mesh import free_port
from voicemesh.tls import ClientTls

pytestmark = pytest.mark.integration


class Terminal:
    """A process whose stdout is a pseudo-terminal, as when a person runs it."""

    def __init__(self, argv: list[str]) -> None:
        main, child = pty.openpty()
        self.process = subprocess.Popen(argv, stdout=child, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(child)
        self._fd = main
        self.output = ""

    def expect(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while (match := re.search(pattern, self.output)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.process.poll() is not None and not select.select([self._fd], [], [], 0)[0]):
                raise AssertionError(f"{pattern!r} did not appear; the terminal showed:\n{self.output}")
            if select.select([self._fd], [], [], min(remaining, 0.5))[0]:
                try:
                    self.output += os.read(self._fd, 65536).decode(errors="replace").replace("\r\n", "\n")
                except OSError:  # the process closed the terminal
                    pass
        return match

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        os.close(self._fd)


def test_up_with_tls_shows_each_turn_and_stops_its_children_on_sigterm() -> None:
    ports = {name: free_port() for name in ("asr", "llm", "tts", "gateway")}
    argv = [sys.executable, "-m", "voicemesh.cli", "up", "--tls", f"--http-port={free_port()}"]
    argv += [f"--{name}-port={port}" for name, port in ports.items()]
    terminal = Terminal(argv)
    try:
        terminal.expect(r"Ctrl-C stops everything", 240)
        ca_file = terminal.expect(r"TLS:\s+CA (\S+)", 1).group(1)
        assert '{"ts"' not in terminal.output, "no JSON log line on the terminal"
        credentials = Credentials(ClientTls(ca_file))
        turns, _, _ = asyncio.run(
            talk(
                f"localhost:{ports['gateway']}", load_clip("spk2_snt1"), trailing_silence_s=5.0, credentials=credentials
            )
        )
        assert turns and turns[0].reply_text
        line = terminal.expect(r"\] turn 0: heard (\".*?\") -> replied \".*\"\s+V2V \d+ ms", 30)
        assert "war" in line.group(1).lower()
        terminal.process.send_signal(signal.SIGTERM)
        assert terminal.process.wait(60) == 0
        terminal.expect(r"stopped\.", 5)
        for name, port in ports.items():
            with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
                probe.connect(("127.0.0.1", port))
                pytest.fail(f"{name} still listens on {port} after SIGTERM")
    finally:
        terminal.close()
