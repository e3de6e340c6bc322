"""Typed settings for every process: one frozen dataclass per service, read once in `main` from flags or env.

A field `cpu_threads` of a service with prefix `asr` is set by `--cpu-threads` or `VOICEMESH_ASR_CPU_THREADS`
(the flag wins). Each field documents itself with `setting(default, "help")`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # typeshed's protocol for "a dataclass", which exists only for type checkers
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def setting(default: Any, doc: str) -> Any:
    """A settings field with its default and one line of help."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What every gRPC server has."""

    host: str = setting("127.0.0.1", "address to bind; 0.0.0.0 in containers")
    port: int = setting(0, "gRPC port")
    drain_grace_s: float = setting(10.0, "on SIGTERM: stop accepting, let in-flight streams finish this long")
    max_message_bytes: int = setting(4 * 1024 * 1024, "largest gRPC message accepted or sent")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    metrics_port: int = setting(0, "Prometheus /metrics port (0 = no endpoint)")
    trace_file: str = setting("", "append finished spans to this JSONL file (OTLP export is set by OTEL_* env)")
    tls_cert: str = setting("", "PEM certificate: serve gRPC over TLS (with tls_key); empty = plaintext")
    tls_key: str = setting("", "PEM private key of tls_cert")
    tls_client_ca: str = setting("", "PEM CA: callers must present a certificate it signed (mutual TLS)")
    health_port: int = setting(
        0, "plaintext port serving only grpc.health.v1, for probes that cannot do TLS or tokens (0 = none)"
    )
    auth_token: str = setting(
        "", "static bearer token callers must send (`authorization: Bearer <token>`); empty = none"
    )
    jwt_keys: str = setting(
        "",
        "HS256 keys that sign accepted JWTs (which must carry sub and exp): kid:secret[,kid:secret] so a new key "
        "can be added before the old one is removed; empty = none. With neither this nor auth_token, no auth",
    )
    jwt_audience: str = setting("", "the `aud` accepted JWTs must carry; empty = not checked")
    log_transcripts: bool = setting(
        False, "put what users said and what was replied in logs and spans (personal data: off unless debugging)"
    )


def _parse(kind: Any, raw: str) -> Any:
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {raw!r}")
    return kind(raw)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one `--flag` per settings field (default None so env and defaults can fill in later)."""
    for field in dataclasses.fields(cls):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            default=None,
            help=f"{field.metadata.get('doc', '')} (default {field.default!r})",
        )


def build(
    cls: type[T],
    prefix: str,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> T:
    """Build settings: flag value, else `VOICEMESH_<PREFIX>_<FIELD>` from env, else the default."""
    flags = flags or {}
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    known = {f"VOICEMESH_{prefix.upper()}_{field.name.upper()}" for field in dataclasses.fields(cls)}
    unknown = sorted(k for k in env if k.startswith(f"VOICEMESH_{prefix.upper()}_") and k not in known)
    if unknown:  # a typo in a deployment would otherwise be silently ignored
        raise SystemExit(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw = flags.get(field.name)
        name = f"VOICEMESH_{prefix.upper()}_{field.name.upper()}"
        if raw is None:
            raw = env.get(name)
        if raw is None:
            continue
        try:
            values[field.name] = _parse(hints[field.name], str(raw))
        except ValueError as exc:
            raise SystemExit(f"setting {field.name} (--{field.name.replace('_', '-')} or {name}): {exc}") from exc
    return cls(**values)


def from_argv(cls: type[T], prefix: str, argv: Sequence[str] | None = None, prog: str | None = None) -> T:
    """Parse `argv` (flags only) into settings of `cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_arguments(parser, cls)
    return build(cls, prefix, vars(parser.parse_args(argv)))
