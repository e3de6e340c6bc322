"""The result of one named check: what failed, what it covered, how long it took."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Check:
    """One named check: its failures (empty = passed) and a one-line summary of what it covered."""

    name: str
    failures: list[str] = field(default_factory=list)
    summary: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures
