"""What `voicemesh up` shows a person on a terminal: one short line per turn, session and problem, read from
the services' JSON log files (which keep everything)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

POLL_S = 0.2
MAX_TEXT_CHARS = 60


def human_line(service: str, record: Mapping[str, Any]) -> str | None:
    """The line a person wants for one log record, or None for the records that only a log pipeline wants."""
    message = str(record.get("msg", ""))
    session = str(record.get("session_id", ""))[:8]
    if service == "gateway" and message == "turn":
        heard, replied = _quote(record.get("user_text")), _quote(record.get("reply_text"))
        words = f"heard {heard} -> replied {replied}  " if heard or replied else ""
        return f"[{session}] turn {record.get('turn')}: {words}V2V {_ms(record.get('v2v_ms'))}"
    if service == "gateway" and message in ("session started", "session ended", "barge-in"):
        return f"[{session}] {message}"
    if record.get("level") in ("WARNING", "ERROR", "CRITICAL"):
        details = ", ".join(
            f"{key}={record[key]}" for key in ("stage", "code", "reason", "error", "exc") if record.get(key)
        )
        where = f"[{session}] " if session else ""
        return f"{where}{service} {str(record['level']).lower()}: {message}{f' ({details})' if details else ''}"
    return None


def parse(line: str) -> dict[str, Any] | None:
    """A JSON log record, or None for anything else a process printed (a library's own output)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


async def follow(paths: Mapping[str, Path], stop: asyncio.Event) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(service, record) for every JSON line appended to each service's log file, until `stop` is set."""
    offsets = dict.fromkeys(paths, 0)
    pending = dict.fromkeys(paths, "")
    while not stop.is_set():
        for service, path in paths.items():
            chunk, offsets[service] = _read_from(path, offsets[service])
            *lines, pending[service] = (pending[service] + chunk).split("\n")
            for line in lines:
                record = parse(line)
                if record is not None:
                    yield service, record
        try:
            await asyncio.wait_for(stop.wait(), POLL_S)
        except TimeoutError:
            pass


def _read_from(path: Path, offset: int) -> tuple[str, int]:
    """What a file holds past `offset`, and the new offset (a few KB a poll: cheap enough for the event loop)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            file.seek(offset)
            return file.read(), file.tell()
    except FileNotFoundError:
        return "", offset


def tail(path: Path, lines: int = 20) -> Sequence[str]:
    """The last lines of a log file, for saying why a service died."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return []


def _quote(text: object) -> str:
    if not text:
        return ""
    text = str(text)
    return json.dumps(text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 1] + "…", ensure_ascii=False)


def _ms(value: object) -> str:
    return f"{value:.0f} ms" if isinstance(value, int | float) and value else "-"
