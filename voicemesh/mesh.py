"""Start services as separate processes on loopback (as pods would run), wait for health, stop them cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from voicemesh.cpus import available_cpus, budget_env
from voicemesh.serving import health_check
from voicemesh.tls import LocalCertificates

STAGES = ("asr", "llm", "tts")
DEFAULT_PORTS = {"asr": 50061, "llm": 50062, "tts": 50063, "gateway": 50051}


async def wait_healthy(target: str, timeout_s: float = 120.0, service: str = "") -> None:
    """Poll grpc.health.v1 until SERVING; raises TimeoutError naming the target."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(target) as channel:
        check = health_check(channel)
        while True:
            try:
                reply = await check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} not SERVING after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)


def turn_fusion_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The ASR fuses the LLM's turn-end score by the fit on the scorer the LLM uses, as the chart sets it: an
    operator who picks the LLM's scorer alone gets the matching fusion (their own ASR setting stays theirs)."""
    scorer = environ.get("VOICEMESH_LLM_TURN_END_SCORER")
    if not scorer or "VOICEMESH_ASR_TURN_FUSION" in environ:
        return {}
    return {"VOICEMESH_ASR_TURN_FUSION": scorer}


@dataclass
class Process:
    name: str
    target: str
    popen: subprocess.Popen[bytes]
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    health_target: str = ""
    """Where its plaintext health service answers, when that is not `target` (a TLS or token-guarded port)."""


class Mesh:
    """A set of voicemesh service processes on loopback."""

    def __init__(self, log_dir: str | None = None) -> None:
        self.processes: dict[str, Process] = {}
        self.log_dir = log_dir

    def start(self, name: str, port: int, args: Sequence[str] = (), env: dict[str, str] | None = None) -> Process:
        """Start `voicemesh serve NAME --port PORT ARGS...` (not waiting for health)."""
        kind = name.split("-")[0]
        argv = [sys.executable, "-m", "voicemesh.cli", "serve", kind, "--port", str(port), *args]
        process = Process(name, f"127.0.0.1:{port}", self._spawn(name, argv, env), argv, env or {})
        self.processes[name] = process
        return process

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen[bytes]:
        if not self.log_dir:
            return subprocess.Popen(argv, env={**os.environ, **(env or {})})
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as log_file:
            return subprocess.Popen(argv, env={**os.environ, **(env or {})}, stderr=log_file)

    def start_local(
        self,
        ports: Mapping[str, int],
        http_port: int,
        gateway_args: Sequence[str] = (),
        tls: LocalCertificates | None = None,
        service_token: str = "",
        cpus: int | None = None,
        metrics_ports: Mapping[str, int] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """ASR, LLM and TTS, and a gateway wired to them (browser doors on `http_port`; -1 = none).

        The engines' threads come from one CPU budget of `cpus` cores (default: those this process may use), so
        that they do not oversubscribe the box (`voicemesh.cpus`).

        With `tls`, every gRPC port serves TLS: the services want the gateway's client certificate (mutual TLS)
        and `service_token`, and each process answers probes on a plaintext health-only port. `metrics_ports`: where
        each process (by name) serves /metrics; `env`: more variables for every process (OTEL_* ...)."""
        secure: list[str] = []
        if tls is not None:
            secure = [f"--tls-cert={tls.server.cert_file}", f"--tls-key={tls.server.key_file}"]
        budget = budget_env(cpus or available_cpus())
        budget["asr"].update(turn_fusion_env({**os.environ, **(env or {})}))
        for name in STAGES:
            args = [*secure, f"--tls-client-ca={tls.ca_file}"] if tls is not None else []
            if service_token:
                args.append(f"--auth-token={service_token}")
            if metrics_ports:
                args.append(f"--metrics-port={metrics_ports[name]}")
            self._start_guarded(
                name, ports[name], args, tls is not None or bool(service_token), {**budget[name], **(env or {})}
            )
        targets = [f"--{name}-target=127.0.0.1:{ports[name]}" for name in STAGES]
        client = []
        if tls is not None:
            client = [
                f"--service-tls-ca={tls.ca_file}",
                f"--service-tls-cert={tls.client.cert_file}",
                f"--service-tls-key={tls.client.key_file}",
            ]
        if service_token:
            client.append(f"--service-token={service_token}")
        if metrics_ports:
            client.append(f"--metrics-port={metrics_ports['gateway']}")
        gateway = [*targets, f"--http-port={http_port}", *secure, *client, *gateway_args]
        self._start_guarded("gateway", ports["gateway"], gateway, tls is not None, dict(env or {}))

    def _start_guarded(
        self, name: str, port: int, args: list[str], guarded: bool, env: dict[str, str] | None = None
    ) -> None:
        if not guarded:
            self.start(name, port, args, env)
            return
        health_port = free_port()
        process = self.start(name, port, [*args, f"--health-port={health_port}"], env)
        process.health_target = f"127.0.0.1:{health_port}"

    def restart(self, name: str) -> Process:
        """Start a stopped or killed service again with the same arguments."""
        old = self.processes[name]
        self.stop(name)
        process = Process(name, old.target, self._spawn(name, old.argv, old.env), old.argv, old.env, old.health_target)
        self.processes[name] = process
        return process

    async def wait(self, timeout_s: float = 180.0, names: Sequence[str] | None = None) -> None:
        """Wait until the named services (default: all) report SERVING; raises if one exits first."""

        async def one(process: Process) -> None:
            task = asyncio.ensure_future(wait_healthy(process.health_target or process.target, timeout_s))
            while not task.done():
                if process.popen.poll() is not None:
                    task.cancel()
                    raise RuntimeError(f"{process.name} exited with {process.popen.returncode} while starting")
                await asyncio.sleep(0.2)
            task.result()

        await asyncio.gather(*(one(self.processes[n]) for n in (names or list(self.processes))))

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would."""
        process = self.processes[name]
        process.popen.kill()
        process.popen.wait()

    def freeze(self, name: str) -> None:
        """SIGSTOP, as a hung process (or a VM paused under it) would be: connections stay open, nothing answers."""
        self.processes[name].popen.send_signal(signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        """SIGCONT: a frozen service goes on."""
        self.processes[name].popen.send_signal(signal.SIGCONT)

    def stop(self, name: str, timeout_s: float = 15.0) -> None:
        process = self.processes[name]
        if process.popen.poll() is None:
            process.popen.send_signal(signal.SIGCONT)  # a frozen process handles no SIGTERM until it goes on
            process.popen.send_signal(signal.SIGTERM)
            try:
                process.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        for name in list(self.processes):
            self.stop(name)


_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on right now, below the kernel's ephemeral range: a port from that range
    (what binding port 0 gives) can be taken, before the service binds it, as the source port of any outgoing
    connection, which made a mesh's startup fail now and then."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _GIVEN:  # handed out before, maybe not bound yet
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    with socket.socket() as sock:  # an unusual port range: fall back to one the kernel picks
        sock.bind(("127.0.0.1", 0))
        picked: int = sock.getsockname()[1]
        return picked


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _start_local_mesh(log_prefix: str, door: str) -> tuple[Mesh, str]:
    mesh = Mesh(log_dir=tempfile.mkdtemp(prefix=log_prefix))
    ports = {name: free_port() for name in DEFAULT_PORTS}
    http_door = door in ("ws", "twilio", "realtime")
    http_port = free_port() if http_door else -1
    phone = [f"--twilio-auth-token={LOCAL_TWILIO_AUTH_TOKEN}"] if door == "twilio" else []
    mesh.start_local(ports, http_port=http_port, gateway_args=phone)
    return mesh, f"127.0.0.1:{http_port if http_door else ports['gateway']}"


# The Twilio auth token of a local mesh's phone door (`door` "twilio"), which this process's test carrier signs with.
LOCAL_TWILIO_AUTH_TOKEN = secrets.token_urlsafe(24)


@contextlib.contextmanager
def local_mesh(log_prefix: str = "voicemesh-", door: str = "grpc") -> Iterator[str]:
    """ASR, LLM, TTS and a gateway as processes on free loopback ports; yields the gateway's gRPC target, or with
    `door` "ws" or "twilio" its HTTP door (otherwise not started; "twilio" opens its phone door). For synchronous code; `started_local_mesh` in a loop."""
    mesh, target = _start_local_mesh(log_prefix, door)
    try:
        asyncio.run(mesh.wait(timeout_s=240))
        yield target
    finally:
        mesh.stop_all()


@contextlib.asynccontextmanager
async def started_local_mesh(log_prefix: str = "voicemesh-", door: str = "grpc") -> AsyncIterator[str]:
    """`local_mesh` from a running event loop."""
    mesh, target = _start_local_mesh(log_prefix, door)
    try:
        await mesh.wait(timeout_s=240)
        yield target
    finally:
        mesh.stop_all()
