"""Which paths of the build context a .dockerignore leaves out, by Docker's rules, matched with pathspec."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pathspec


class DockerIgnore:
    """A parsed .dockerignore.

    Docker's rules (moby/patternmatcher, as BuildKit applies them) are gitignore's wildcards (`*`, `?`,
    `[...]`, `**` for any number of directories) with three differences, which the translation below makes:
    every pattern is relative to the context root (`*.pyc` is only the top level's; gitignore would match it
    at any depth), so each is anchored with a leading `/`; a pattern that matches a directory also matches
    everything below it, so each gets a twin `<pattern>/**`; and the last matching line decides even inside
    an excluded directory (`*` then `!voicemesh` keeps voicemesh/), which pathspec's plain `PathSpec` does,
    where git (and pathspec's `GitIgnoreSpec`) would not re-include.
    """

    def __init__(self, lines: Iterable[str], name: str = ".dockerignore") -> None:
        self.name = name
        #: The patterns as Docker reads them (cleaned, root-relative), "!" kept.
        self.patterns: list[str] = []
        gitignore_lines: list[str] = []
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            pattern = os.path.normpath(line[1:] if negated else line).lstrip("/")
            if pattern in ("", "."):
                continue  # the context root itself: Docker never leaves it out
            sign = "!" if negated else ""
            self.patterns.append(sign + pattern)
            gitignore_lines += [f"{sign}/{pattern}", f"{sign}/{pattern}/**"]
        self._spec = pathspec.PathSpec.from_lines("gitignore", gitignore_lines)

    @classmethod
    def from_file(cls, path: Path) -> DockerIgnore:
        """The .dockerignore at path; an absent file leaves nothing out."""
        return cls(path.read_text().splitlines() if path.exists() else [], name=path.name)

    def excluding_pattern(self, path: str) -> str | None:
        """The pattern that leaves path (relative to the context) out, or None if the build context keeps it."""
        result = self._spec.check_file(os.path.normpath(path))
        if not result.include or result.index is None:
            return None
        return self.patterns[result.index // 2]

    def excludes(self, path: str) -> bool:
        """Whether the build context leaves path (relative to the context root) out."""
        return self.excluding_pattern(path) is not None
