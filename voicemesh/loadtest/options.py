"""What one load test does (`LoadTestOptions`, every default in one place) and what the harness refuses to do."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from voicemesh.clients import PLAINTEXT, Credentials
from voicemesh.mesh import DEFAULT_PORTS

MAX_SESSIONS = 512
MAX_TURNS = 100
TRANSPORTS = ("grpc", "ws", "twilio", "realtime")
ARRIVALS = ("staggered", "sync")


class LoadTestError(Exception):
    """A load test that cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class LoadTestOptions:
    """What one load test does. Defaults live here and nowhere else."""

    target: str = f"127.0.0.1:{DEFAULT_PORTS['gateway']}"
    """Gateway address, HOST:PORT: its gRPC port, or with `transport` ws its HTTP door (`voicemesh up` prints
    both). Empty: `run_loadtest`/`run_sweep` start a local mesh of their own."""
    sessions: int = 2
    """Concurrent conversations (1-512)."""
    turns: int = 2
    """Clips each session speaks, one turn each (1-100)."""
    audio: tuple[str, ...] = ()
    """WAV files or directories of them (every *.wav); sessions cycle through them, each starting elsewhere."""
    transport: str = "grpc"
    """`grpc` (Conversation.Converse), `ws` (the WebSocket door /api/ws, as a browser page speaks it) or `twilio`
    (the phone door, calls placed as Twilio places them: `target` is the HTTP door) or `realtime` (the OpenAI
    Realtime door /v1/realtime on the HTTP door)."""
    ramp_s: float = 1.0
    """Session starts are spread evenly over this long (`staggered` arrival)."""
    arrival: str = "staggered"
    """`staggered`: sessions start over `ramp_s` and each goes at its own pace (think times, reply lengths), as
    real callers do. `sync`: every session starts at once and speaks each turn's clip at the same moment as the
    others (a session that is done waits for the rest): the worst case, where all turns' urgent work collides."""
    duration_s: float = 300.0
    """Hard limit for the whole test; turns still running then fail with DURATION_LIMIT."""
    pause_s: tuple[float, float] = (0.5, 1.5)
    """Think time after each reply before the next clip (`--think-s`), drawn uniformly from this range with
    `seed`."""
    turn_timeout_s: float = 30.0
    """A turn whose reply has not finished this long after its clip fails with TIMEOUT."""
    allow_remote: bool = False
    """Non-loopback targets are refused unless this is set."""
    seed: int = 0
    """Seed of the pauses, so two runs pause alike."""
    credentials: Credentials = field(default=PLAINTEXT, repr=False)
    """TLS and token to reach the gateway with; never written to the report."""
    twilio_auth_token: str = field(default="", repr=False)
    """The gateway's twilio_auth_token, which the test carrier signs its webhooks with (`transport` twilio)."""


def is_loopback(target: str) -> bool:
    """Whether a gRPC target (HOST:PORT, [IPv6]:PORT, unix:PATH) stays on this machine."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_options(options: LoadTestOptions) -> None:
    """Refuse what this harness must not or cannot do, with a message saying what to change."""
    if not 1 <= options.sessions <= MAX_SESSIONS:
        raise LoadTestError(f"sessions={options.sessions}: use 1-{MAX_SESSIONS}")
    if not 1 <= options.turns <= MAX_TURNS:
        raise LoadTestError(f"turns={options.turns}: use 1-{MAX_TURNS}")
    if options.duration_s <= 0 or options.ramp_s < 0 or options.turn_timeout_s <= 0:
        raise LoadTestError("duration_s and turn_timeout_s must be positive, ramp_s zero or more")
    low_s, high_s = options.pause_s
    if not 0 <= low_s <= high_s:
        raise LoadTestError(f"pause_s={options.pause_s}: give (low, high) with 0 <= low <= high")
    if not options.audio:
        raise LoadTestError("no audio: give --audio with a 16-bit WAV file or a directory of them")
    if options.arrival not in ARRIVALS:
        raise LoadTestError(f"arrival={options.arrival!r}: use one of {', '.join(ARRIVALS)}")
    if options.transport not in TRANSPORTS:
        raise LoadTestError(f"transport={options.transport!r}: use one of {', '.join(TRANSPORTS)}")
    if not options.allow_remote and not is_loopback(options.target):
        raise LoadTestError(
            f"target {options.target} is not a loopback address; load-testing another machine needs --allow-remote"
        )
