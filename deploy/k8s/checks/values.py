"""The chart's values files: every field of values.yaml documented, no unknown keys in the overlays."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .settings import CHART_DIR, FREE_FORM_KEYS

_KEY_LINE = re.compile(r"^(\s*)([A-Za-z0-9_.-]+|\"[^\"]+\"):(\s|$)")


def values_documentation_problems(path: Path = CHART_DIR / "values.yaml") -> list[str]:
    """Every mapping key of values.yaml outside list items has a comment above it or beside it."""
    problems = []
    lines = path.read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, is list item) of the open ancestors
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        is_item = stripped.startswith("- ")
        in_list = any(item for _, item in stack)
        match = _KEY_LINE.match(line)
        if match and not is_item and not in_list:
            previous = lines[number - 2].strip() if number > 1 else ""
            if not previous.startswith("#") and " #" not in line:
                problems.append(f"{path.name}:{number}: {match.group(2)} has no comment")
        stack.append((indent, is_item))
    return problems


def unknown_keys(overlay: dict[str, Any], defaults: dict[str, Any], path: str = "") -> list[str]:
    """Keys of an overlay that values.yaml does not define (typos), below FREE_FORM_KEYS excepted."""
    problems = []
    for key, value in overlay.items():
        here = f"{path}.{key}" if path else key
        if key not in defaults:
            problems.append(f"unknown key {here}")
        elif key in FREE_FORM_KEYS or not isinstance(defaults[key], dict) or not defaults[key]:
            continue
        elif isinstance(value, dict):
            problems += unknown_keys(value, defaults[key], here)
    return problems
