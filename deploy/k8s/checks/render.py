"""Render the chart offline with Helm's Go SDK (helm-python-sdk): values layering, templates, helm lint."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml

from .settings import CHART_DIR, KUBERNETES_VERSION, NAMESPACE, RELEASE, SCENARIOS


@dataclass
class Rendered:
    """One scenario's render: the template outputs (path -> text), the parsed objects, the merged values."""

    scenario: str
    files: dict[str, str]
    objects: list[dict[str, Any]]
    values: dict[str, Any]
    release: str = RELEASE
    namespace: str = NAMESPACE


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Helm's -f layering: maps merge key by key, anything else replaces, null deletes."""
    merged = dict(base)
    for key, value in overlay.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_values_file(path: Path) -> dict[str, Any]:
    """Parse a values file exactly as helm does (YAML -> JSON types)."""
    return helm_python.values_from_yaml(path.read_text())


def overlay_values(overlays: Iterable[str | Path]) -> dict[str, Any]:
    """The merged user values of overlay files (paths relative to the chart, or absolute)."""
    values: dict[str, Any] = {}
    for overlay in overlays:
        path = Path(overlay)
        if not path.is_absolute():
            path = CHART_DIR / path
        values = deep_merge(values, load_values_file(path))
    return values


def render(
    overlays: Iterable[str | Path] = (),
    *,
    set_values: dict[str, Any] | None = None,
    scenario: str = "custom",
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Rendered:
    """Render the chart offline with values.yaml + overlays (+ set_values, like --set) and parse the output."""
    values = overlay_values(overlays)
    if set_values:
        values = deep_merge(values, set_values)
    with helm_python.Chart.load(CHART_DIR) as chart:
        files = chart.render(values=values, name=release, namespace=namespace, is_install=True)
        merged = chart.merge_values(values)
    objects: list[dict[str, Any]] = []
    for path in sorted(files):
        if path.endswith("NOTES.txt"):
            continue
        for document in yaml.safe_load_all(files[path]):
            if document:
                document.setdefault("metadata", {})
                objects.append(document)
    return Rendered(
        scenario=scenario, files=files, objects=objects, values=merged, release=release, namespace=namespace
    )


def render_scenario(name: str) -> Rendered:
    """Render one of SCENARIOS by name."""
    return render(SCENARIOS[name], scenario=name)


def manifest_files(rendered: Rendered) -> dict[str, str]:
    """Rendered manifests worth writing to disk: template file name -> YAML text (empty outputs dropped)."""
    out = {}
    for path, text in sorted(rendered.files.items()):
        if path.endswith("NOTES.txt") or not text.strip():
            continue
        out[path.split("/templates/", 1)[-1]] = text.lstrip("\n")
    return out


def lint_chart(overlays: Iterable[str | Path]) -> list[str]:
    """helm lint --strict against the pinned Kubernetes version."""
    report = helm_python.lint(
        CHART_DIR, overlay_values(overlays), strict=True, namespace=NAMESPACE, kube_version=f"v{KUBERNETES_VERSION}"
    )
    problems = [
        f"helm lint: {m.get('path')}: {m.get('error')}" for m in report.get("messages", []) if m.get("severity", 0) >= 2
    ]
    problems += [f"helm lint: {e}" for e in report.get("errors", []) or []]
    return problems
