"""A/B variants of a local mesh for the benchmarks: a name and the VOICEMESH_* environment its processes start with."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """NAME:VAR=VALUE,VAR=VALUE (no variables: the mesh's defaults)."""
    name, _, assignments = text.partition(":")
    environment = dict(item.split("=", 1) for item in assignments.split(",") if item)
    if not name or not all(variable.startswith("VOICEMESH_") for variable in environment):
        raise SystemExit(f"--variant {text!r}: give NAME:VOICEMESH_...=VALUE[,...]")
    return name, environment


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ (which the mesh's processes inherit) for the block."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
