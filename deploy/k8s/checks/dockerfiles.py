"""The service images' Dockerfiles (dockerfile-parse): COPY sources in the build context, and the image contract."""

from __future__ import annotations

import json
import os
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

from dockerfile_parse import DockerfileParser

from .dockerignore import DockerIgnore
from .render import load_values_file
from .results import Check
from .settings import CHART_DIR, IMAGES, IMAGES_DIR, REPO_ROOT


def dockerfiles_check(images_dir: Path = IMAGES_DIR) -> Check:
    """Every image in IMAGES has a Dockerfile, and each Dockerfile passes dockerfile_problems."""
    check = Check("Dockerfiles")
    paths = sorted(images_dir.glob("*.Dockerfile"))
    missing = sorted(set(IMAGES) - {p.name.removesuffix(".Dockerfile") for p in paths})
    check.failures += [f"missing {name}.Dockerfile" for name in missing]
    for path in paths:
        problems, notes = dockerfile_problems(path)
        check.failures += problems
        check.notes += notes
    check.summary = f"{len(paths)} Dockerfiles parsed, COPY sources checked against {REPO_ROOT}"
    return check


def instruction_args(value: str) -> list[str]:
    """An instruction's arguments, from its JSON (exec) form or its shell form."""
    value = value.strip()
    if value.startswith("["):
        return [str(v) for v in json.loads(value)]
    return shlex.split(value)


def dockerfile_problems(path: Path) -> tuple[list[str], list[str]]:
    """(problems, notes) for one Dockerfile: COPY sources exist and are in the context, plus the image contract."""
    parser = DockerfileParser(path=str(path))
    ignore = DockerIgnore.from_file(path.with_name(path.name + ".dockerignore"))
    problems = copy_problems(path.name, parser.structure, ignore)
    stem = path.name.removesuffix(".Dockerfile")
    if stem not in IMAGES:
        problems.append(f"{path.name}: unknown image (expected one of {', '.join(IMAGES)})")
        return problems, []
    contract, notes = contract_problems(path, parser)
    return problems + contract, notes


def copy_problems(name: str, instructions: list[dict[str, Any]], ignore: DockerIgnore) -> list[str]:
    """COPY/ADD: --from names an earlier stage; every other source exists in the repository and survives ignore."""
    problems: list[str] = []
    stages: list[str] = []
    for instruction in instructions:
        kind, value = instruction["instruction"], instruction["value"]
        where = f"{name}:{instruction['startline'] + 1}"
        if kind == "FROM":
            words = value.split()
            if len(words) == 3 and words[1].upper() == "AS":
                stages.append(words[2])
        if kind not in ("COPY", "ADD"):
            continue
        args = instruction_args(value)
        flags = [a for a in args if a.startswith("--")]
        sources = [a for a in args if not a.startswith("--")][:-1]
        from_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
        if from_stage is not None:
            if from_stage not in stages:
                problems.append(f"{where}: COPY --from={from_stage}: no such earlier stage")
            continue
        for source in sources:
            relative = os.path.normpath(source)
            if not any(REPO_ROOT.glob(relative)) and not (REPO_ROOT / relative).exists():
                problems.append(f"{where}: COPY source {source} does not exist in the repository")
            elif (pattern := ignore.excluding_pattern(relative)) is not None:
                problems.append(f"{where}: COPY source {source} is excluded by {ignore.name} ({pattern})")
    return problems


def contract_problems(path: Path, parser: DockerfileParser) -> tuple[list[str], list[str]]:
    """What the chart and pyproject expect of the image: stages, base, extra, user, health check, entrypoint."""
    instructions = parser.structure
    component, extra = IMAGES[path.name.removesuffix(".Dockerfile")]
    port = int(load_values_file(CHART_DIR / "values.yaml")[component]["port"])
    text = path.read_text()
    problems: list[str] = []
    froms = [i for i in instructions if i["instruction"] == "FROM"]
    if len(froms) < 2:
        problems.append(f"{path.name}: not multi-stage")
    if parser.baseimage != "python:3.11-slim":
        problems.append(f"{path.name}: runtime base {parser.baseimage} is not python:3.11-slim")
    if f'pip install ".[{extra}]"' not in text:
        problems.append(f'{path.name}: does not pip install ".[{extra}]"')
    users = [i["value"].strip() for i in instructions if i["instruction"] == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"{path.name}: runs as root")
    healthchecks = [i["value"] for i in instructions if i["instruction"] == "HEALTHCHECK"]
    expected_health = f'CMD ["voicemesh", "health", "--target", "127.0.0.1:{port}"]'
    if not healthchecks or expected_health not in " ".join(healthchecks[-1].split()):
        problems.append(f"{path.name}: HEALTHCHECK is not {expected_health}")
    entrypoints = [i["value"] for i in instructions if i["instruction"] == "ENTRYPOINT"]
    if not entrypoints or instruction_args(entrypoints[-1]) != ["voicemesh", "serve", component]:
        problems.append(f"{path.name}: ENTRYPOINT is not voicemesh serve {component}")
    problems += _pyproject_problems(path.name, extra, text)
    if path.name == "llm.Dockerfile" and "CMAKE_ARGS=-DGGML_NATIVE=OFF" not in text:
        problems.append(f"{path.name}: llama.cpp must build with CMAKE_ARGS=-DGGML_NATIVE=OFF")
    notes = [
        f"{path.name}: {len(froms)} stages, extra [{extra}], user {users[-1] if users else '-'}, health port {port}"
    ]
    return problems, notes


def _pyproject_problems(name: str, extra: str, text: str) -> list[str]:
    """The extra exists in pyproject.toml, and the grpcio-tools pin matches pyproject's dev extra."""
    pyproject = REPO_ROOT / "pyproject.toml"
    if not pyproject.exists():
        return []
    extras = tomllib.loads(pyproject.read_text()).get("project", {}).get("optional-dependencies", {})
    problems: list[str] = []
    if extra not in extras:
        problems.append(f'{name}: pyproject.toml has no extra "{extra}" (pip install ".[{extra}]" would fail)')
    tools = [r for r in extras.get("dev", []) if re.match(r"grpcio-tools\s*==", r)]
    pinned = re.search(r"ARG GRPCIO_TOOLS_VERSION=(\S+)", text)
    if tools and pinned and tools[0].split("==", 1)[1].strip() != pinned.group(1):
        problems.append(f"{name}: GRPCIO_TOOLS_VERSION={pinned.group(1)} differs from pyproject's dev extra {tools[0]}")
    return problems
