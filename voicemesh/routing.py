"""Which replica serves a call: rendezvous hashing for sticky LLM sessions, least-loaded for stateless stages.

Rendezvous (highest-random-weight) hashing ranks every replica for a session id by hash(session, replica).
It is stateless — every gateway replica and every restart computes the same ranking — and when a replica
leaves, only the sessions that ranked it first move (to their second choice).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


def _weight(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_rank(key: str, replicas: Sequence[str]) -> list[str]:
    """Replicas in the order `key` should try them: highest weight first."""
    return sorted(replicas, key=lambda replica: _weight(key, replica), reverse=True)


def parse_targets(spec: str) -> tuple[list[str], str | None]:
    """`host:port,host:port` (a static list) or `dns:///name:port` (every address the name resolves to).

    Returns (static addresses, dns name:port or None).
    """
    spec = spec.strip()
    if spec.startswith("dns:///"):
        return [], spec.removeprefix("dns:///")
    targets = [t.strip() for t in spec.split(",") if t.strip()]
    if not targets:
        raise ValueError(f"no replica in {spec!r}; give host:port[,host:port...] or dns:///name:port")
    return targets, None


async def resolve_dns(name_port: str) -> list[str]:
    """All IPv4/IPv6 addresses of a headless Service name, as host:port targets."""
    host, _, port = name_port.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = sorted({str(info[4][0]) for info in infos})
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses]


@dataclass
class ReplicaLoad:
    """What the gateway knows of one replica: in-flight calls it sent there, and whether it is reachable."""

    target: str
    in_flight: int = 0
    healthy: bool = True


@dataclass
class ReplicaSet:
    """The live replicas of one stage, from a static list or from DNS re-resolved every `refresh_s`."""

    spec: str
    refresh_s: float = 10.0
    replicas: dict[str, ReplicaLoad] = field(default_factory=dict)

    def __post_init__(self) -> None:
        static, self._dns = parse_targets(self.spec)
        for target in static:
            self.replicas[target] = ReplicaLoad(target)

    async def refresh(self) -> None:
        if self._dns is None:
            return
        try:
            found = await resolve_dns(self._dns)
        except OSError as error:
            log.warning("replica lookup failed; keeping the last set", extra={"name": self._dns, "error": str(error)})
            return
        for target in found:
            self.replicas.setdefault(target, ReplicaLoad(target))
        for gone in set(self.replicas) - set(found):
            del self.replicas[gone]

    def healthy(self) -> list[str]:
        live = [t for t, r in self.replicas.items() if r.healthy]
        return live or list(self.replicas)  # all marked down: try them anyway rather than fail outright

    def sticky_order(self, session_id: str) -> list[str]:
        """LLM: the session's ranking over healthy replicas (its KV/prefix cache lives on the first)."""
        return rendezvous_rank(session_id, self.healthy())

    def least_loaded_order(self) -> list[str]:
        """ASR/TTS: stateless per call, so the replica with the fewest calls in flight first."""
        return sorted(self.healthy(), key=lambda t: (self.replicas[t].in_flight, t))
