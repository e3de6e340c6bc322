"""Offline checks of the Kubernetes deployment: the Helm chart and the service images.

For every values scenario it renders the chart (helm-python-sdk, no cluster), runs helm lint, validates
every object against the Kubernetes JSON schemas (kubernetes-validate, strict), lints the values files and
the rendered manifests (yamllint), checks the wiring between objects (probes, Services, HPA/KEDA/PDB
targets, the gateway's backend targets), and scans the manifests and Dockerfiles with checkov, where a
finding passes only if deploy/k8s/checkov-skips.yaml gives a reason for it. Every Dockerfile is parsed
(dockerfile-parse) and each COPY source must exist in the repository and survive its .dockerignore.

    python deploy/k8s/check.py            # everything; exit status 1 on any failure
    python deploy/k8s/check.py --keep D   # also leave the rendered manifests in D

Tools: deploy/k8s/requirements.txt.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

K8S_DIR = Path(__file__).resolve().parent
REPO_ROOT = K8S_DIR.parent.parent
CHART_DIR = K8S_DIR / "voicemesh"
IMAGES_DIR = K8S_DIR / "images"
YAMLLINT_CONFIG = K8S_DIR / ".yamllint"
CHECKOV_SKIPS = K8S_DIR / "checkov-skips.yaml"

#: Kubernetes version the manifests are validated against (bundled by kubernetes-validate).
KUBERNETES_VERSION = "1.30.0"
RELEASE = "voicemesh"
NAMESPACE = "voicemesh"
COMPONENTS = ("asr", "llm", "tts", "gateway")
BACKENDS = ("asr", "llm", "tts")

#: Values scenarios: name -> overlay files (relative to the chart) applied over values.yaml, in order.
SCENARIOS: dict[str, tuple[str, ...]] = {
    "default": (),
    "cpu-small": ("values-cpu-small.yaml",),
    "gpu": ("values-gpu.yaml",),
    "all-features": ("ci/values-all-features.yaml",),
}

#: values.yaml keys whose children are user-defined (no typo check below them).
FREE_FORM_KEYS = frozenset(
    {
        "resources",
        "affinity",
        "nodeSelector",
        "extraEnv",
        "podAnnotations",
        "podLabels",
        "annotations",
        "podSecurityContext",
        "containerSecurityContext",
    }
)

#: Images: Dockerfile stem -> (chart component, pip extra).
IMAGES: dict[str, tuple[str, str]] = {
    "asr": ("asr", "asr"),
    "llm": ("llm", "llm"),
    "llm-vllm": ("llm", "vllm"),
    "tts": ("tts", "tts"),
    "gateway": ("gateway", "gateway"),
}

#: Custom resources have no schema in kubernetes-validate; these minimal strict schemas stand in.
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "namespace": {"type": "string"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                },
                "additionalProperties": False,
            },
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": {"type": "string"},
                            "envSourceContainerName": {"type": "string"},
                        },
                    },
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                    "idleReplicaCount": {"type": "integer", "minimum": 0},
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "fallback": {"type": "object"},
                    "advanced": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "restoreToOriginalReplicaCount": {"type": "boolean"},
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                            },
                            "scalingModifiers": {"type": "object"},
                        },
                    },
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "additionalProperties": False,
                            "properties": {
                                "type": {"type": "string"},
                                "name": {"type": "string"},
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "useCachedMetrics": {"type": "boolean"},
                                "authenticationRef": {"type": "object"},
                                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            },
                        },
                    },
                },
            },
        },
    },
}


# ---------------------------------------------------------------------------------------------------------
# Results


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


# ---------------------------------------------------------------------------------------------------------
# Rendering


@dataclass
class Rendered:
    """One scenario's render: the template outputs (path -> text), the parsed objects, the merged values."""

    scenario: str
    files: dict[str, str]
    objects: list[dict[str, Any]]
    values: dict[str, Any]
    release: str = RELEASE
    namespace: str = NAMESPACE


def _helm():
    import helm_python  # imported late so the tests can skip cleanly without it

    return helm_python


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
    return _helm().values_from_yaml(path.read_text())


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
    import yaml

    helm = _helm()
    values = overlay_values(overlays)
    if set_values:
        values = deep_merge(values, set_values)
    with helm.Chart.load(CHART_DIR) as chart:
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
    return render(SCENARIOS[name], scenario=name)


def manifest_files(rendered: Rendered) -> dict[str, str]:
    """Rendered manifests worth writing to disk: template file name -> YAML text (empty outputs dropped)."""
    out = {}
    for path, text in sorted(rendered.files.items()):
        if path.endswith("NOTES.txt") or not text.strip():
            continue
        out[path.split("/templates/", 1)[-1]] = text.lstrip("\n")
    return out


# ---------------------------------------------------------------------------------------------------------
# Object helpers


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind and (name is None or o["metadata"].get("name") == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objects, kind, name)
    if len(found) != 1:
        raise LookupError(f"expected one {kind}/{name}, found {len(found)}")
    return found[0]


def object_id(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def component_name(component: str, release: str = RELEASE) -> str:
    """The chart's object name for a component (fullname rule of _helpers.tpl, no overrides)."""
    fullname = release if "voicemesh" in release else f"{release}-voicemesh"
    return f"{fullname}-{component}"


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pods_selected(objects: list[dict[str, Any]], selector: dict[str, str]) -> list[dict[str, Any]]:
    """Deployments whose pod template labels match selector."""
    return [d for d in find(objects, "Deployment") if selects(selector, d["spec"]["template"]["metadata"]["labels"])]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """name -> value (or the valueFrom dict) of the first container's env."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(deployment).get("env", [])}


def port_of(deployment: dict[str, Any], name: str) -> int | None:
    for port in container(deployment).get("ports", []):
        if port.get("name") == name:
            return int(port["containerPort"])
    return None


# ---------------------------------------------------------------------------------------------------------
# Checks on rendered objects


def lint_chart(overlays: Iterable[str | Path]) -> list[str]:
    """helm lint --strict against the pinned Kubernetes version."""
    report = _helm().lint(
        CHART_DIR, overlay_values(overlays), strict=True, namespace=NAMESPACE, kube_version=f"v{KUBERNETES_VERSION}"
    )
    problems = [
        f"helm lint: {m.get('path')}: {m.get('error')}" for m in report.get("messages", []) if m.get("severity", 0) >= 2
    ]
    problems += [f"helm lint: {e}" for e in report.get("errors", []) or []]
    return problems


def validate_objects(objects: list[dict[str, Any]], version: str = KUBERNETES_VERSION) -> tuple[list[str], Counter]:
    """kubernetes-validate --strict on every object; CRDs against CRD_SCHEMAS. Returns (failures, kinds)."""
    import jsonschema
    import kubernetes_validate

    failures: list[str] = []
    kinds: Counter = Counter()
    for obj in objects:
        key = (obj.get("apiVersion"), obj.get("kind"))
        try:
            if key in CRD_SCHEMAS:
                jsonschema.Draft202012Validator(CRD_SCHEMAS[key]).validate(obj)
            else:
                kubernetes_validate.validate(obj, version, strict=True)
            kinds[obj.get("kind")] += 1
        except jsonschema.ValidationError as error:
            where = ".".join(str(p) for p in error.path)
            failures.append(f"{object_id(obj)}: {where}: {error.message}")
        except kubernetes_validate.utils.SchemaNotFoundError as error:
            failures.append(f"{object_id(obj)}: {error.message}")
    return failures, kinds


def wiring_problems(rendered: Rendered) -> list[str]:
    """Cross-object consistency: what the API server would accept but the mesh would not work with."""
    objects, values = rendered.objects, rendered.values

    def name_of(component: str) -> str:
        return component_name(component, rendered.release)

    problems: list[str] = []
    deployments = {d["metadata"]["name"]: d for d in find(objects, "Deployment")}
    services = {s["metadata"]["name"]: s for s in find(objects, "Service")}
    scaled = {
        o["spec"]["scaleTargetRef"]["name"]
        for o in find(objects, "HorizontalPodAutoscaler") + find(objects, "ScaledObject")
    }

    for component in COMPONENTS:
        name = name_of(component)
        deployment = deployments.get(name)
        if deployment is None:
            problems.append(f"no Deployment {name}")
            continue
        spec, pod = deployment["spec"], deployment["spec"]["template"]["spec"]
        ctr = container(deployment)
        env = env_of(deployment)
        if not selects(spec["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"]):
            problems.append(f"{name}: selector does not match its pod labels")
        grpc_port = port_of(deployment, "grpc")
        if grpc_port != values[component]["port"]:
            problems.append(f"{name}: grpc containerPort {grpc_port} != values {component}.port")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            got = ctr.get(probe, {}).get("grpc", {}).get("port")
            if got != grpc_port:
                problems.append(f"{name}: {probe} grpc port {got} != container grpc port {grpc_port}")
        if ctr.get("command") != ["voicemesh", "serve", component]:
            problems.append(f"{name}: command {ctr.get('command')} is not voicemesh serve {component}")
        if ctr.get("imagePullPolicy") != "IfNotPresent":
            problems.append(f"{name}: imagePullPolicy {ctr.get('imagePullPolicy')}")
        if ctr["image"].endswith(":latest") or (":" not in ctr["image"].rsplit("/", 1)[-1] and "@" not in ctr["image"]):
            problems.append(f"{name}: image {ctr['image']} is not pinned")
        prefix = f"VOICEMESH_{component.upper()}_"
        drain = int(env.get(prefix + "DRAIN_GRACE_S", -1))
        sleep = int(ctr["lifecycle"]["preStop"]["exec"]["command"][-1])
        if drain < 0 or pod["terminationGracePeriodSeconds"] < drain + sleep:
            problems.append(
                f"{name}: terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} < preStop {sleep} + drain {drain}"
            )
        if env.get(prefix + "HOST") != "0.0.0.0":
            problems.append(f"{name}: {prefix}HOST is not 0.0.0.0: probes could not reach it")
        mounts = {m["mountPath"] for m in ctr.get("volumeMounts", [])}
        if ctr["securityContext"].get("readOnlyRootFilesystem") and not {"/tmp", "/home/voicemesh"} <= mounts:
            problems.append(f"{name}: read-only root filesystem without writable /tmp and $HOME")
        if (name in scaled) == ("replicas" in spec):
            problems.append(f"{name}: spec.replicas must be set exactly when no HPA/ScaledObject owns it")
        refs = [f["configMapRef"]["name"] for f in ctr.get("envFrom", []) if "configMapRef" in f]
        for ref in refs:
            if not find(objects, "ConfigMap", ref):
                problems.append(f"{name}: envFrom ConfigMap {ref} is not rendered")
        for item in ctr.get("env", []):
            secret = item.get("valueFrom", {}).get("secretKeyRef")
            if (
                secret
                and not find(objects, "Secret", secret["name"])
                and secret["name"] != values["gateway"]["existingSecret"]
            ):
                problems.append(
                    f"{name}: env {item['name']} refers to Secret {secret['name']}, neither rendered nor gateway.existingSecret"
                )
        for volume in pod.get("volumes", []):
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if (
                claim
                and not find(objects, "PersistentVolumeClaim", claim)
                and claim != values["models"]["volume"]["existingClaim"]
            ):
                problems.append(f"{name}: volume claim {claim} neither rendered nor models.volume.existingClaim")

    for service in services.values():
        sname = service["metadata"]["name"]
        targets = pods_selected(objects, service["spec"].get("selector", {}))
        if len(targets) != 1:
            problems.append(f"Service {sname} selects {len(targets)} Deployments")
            continue
        for port in service["spec"]["ports"]:
            if isinstance(port["targetPort"], str) and port_of(targets[0], port["targetPort"]) is None:
                problems.append(
                    f"Service {sname}: targetPort {port['targetPort']} is not a port of {targets[0]['metadata']['name']}"
                )

    gateway = deployments.get(name_of("gateway"))
    if gateway is not None:
        env = env_of(gateway)
        for backend in BACKENDS:
            target = env.get(f"VOICEMESH_GATEWAY_{backend.upper()}_TARGET", "")
            if values["gateway"]["targets"][backend]:
                continue  # an explicit override points outside the chart
            match = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.[a-z0-9.-]+:(\d+)", str(target))
            if not match:
                problems.append(f"gateway {backend} target {target!r} is not dns:///<headless>.<ns>.svc...:<port>")
                continue
            headless = services.get(match.group(1))
            backend_deployment = deployments.get(name_of(backend))
            if headless is None or headless["spec"].get("clusterIP") != "None":
                problems.append(f"gateway {backend} target {target}: no headless Service {match.group(1)}")
            elif backend_deployment is None or not selects(
                headless["spec"]["selector"], backend_deployment["spec"]["template"]["metadata"]["labels"]
            ):
                problems.append(f"gateway {backend} target {target}: Service does not select the {backend} pods")
            elif int(match.group(3)) != port_of(backend_deployment, "grpc"):
                problems.append(f"gateway {backend} target {target}: port is not the {backend} grpc port")
            if headless is not None and match.group(2) != headless["metadata"].get("namespace"):
                problems.append(f"gateway {backend} target {target}: namespace differs from the Service's")

    for kind in ("HorizontalPodAutoscaler", "ScaledObject"):
        for obj in find(objects, kind):
            ref = obj["spec"]["scaleTargetRef"]
            if ref.get("kind", "Deployment") != "Deployment" or ref["name"] not in deployments:
                problems.append(f"{object_id(obj)} targets {ref.get('kind')}/{ref['name']}, not a rendered Deployment")
    hpa_targets = Counter(
        o["spec"]["scaleTargetRef"]["name"]
        for o in find(objects, "HorizontalPodAutoscaler") + find(objects, "ScaledObject")
    )
    problems += [f"{n} has {c} autoscalers" for n, c in hpa_targets.items() if c > 1]
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for obj in find(objects, kind):
            selector = obj["spec"]["selector" if kind == "PodDisruptionBudget" else "podSelector"]["matchLabels"]
            if len(pods_selected(objects, selector)) != 1:
                problems.append(f"{object_id(obj)} selects {len(pods_selected(objects, selector))} Deployments")
    for policy in find(objects, "NetworkPolicy"):
        target = pods_selected(objects, policy["spec"]["podSelector"]["matchLabels"])
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if isinstance(port.get("port"), str) and target and port_of(target[0], port["port"]) is None:
                    problems.append(f"{object_id(policy)}: port {port['port']} is not a port of the pods")
    return problems


def lint_yaml(documents: dict[str, str]) -> list[str]:
    """yamllint (deploy/k8s/.yamllint) on name -> text; warnings count as failures."""
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig(file=str(YAMLLINT_CONFIG))
    problems = []
    for name, text in documents.items():
        for problem in linter.run(text, config):
            problems.append(
                f"{name}:{problem.line}:{problem.column}: [{problem.level}] {problem.desc} ({problem.rule})"
            )
    return problems


# ---------------------------------------------------------------------------------------------------------
# Values files


def values_documentation_problems(path: Path = CHART_DIR / "values.yaml") -> list[str]:
    """Every mapping key of values.yaml outside list items has a comment above it or beside it."""
    problems = []
    lines = path.read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, is list item) of the open ancestors
    key_line = re.compile(r"^(\s*)([A-Za-z0-9_.-]+|\"[^\"]+\"):(\s|$)")
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        is_item = stripped.startswith("- ")
        in_list = any(item for _, item in stack)
        match = key_line.match(line)
        if match and not is_item and not in_list:
            previous = lines[number - 2].strip() if number > 1 else ""
            if not previous.startswith("#") and " #" not in line:
                problems.append(f"values.yaml:{number}: {match.group(2)} has no comment")
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


# ---------------------------------------------------------------------------------------------------------
# Dockerfiles


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides; ! re-includes."""
    parts = Path(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = os.path.normpath(raw[1:] if negate else raw).lstrip("/")
        if any(fnmatch.fnmatchcase(candidate, pattern) for candidate in candidates):
            excluded = not negate
    return excluded


def _instruction_args(value: str) -> list[str]:
    value = value.strip()
    if value.startswith("["):
        return [str(v) for v in json.loads(value)]
    return shlex.split(value)


def dockerfile_problems(path: Path) -> tuple[list[str], list[str]]:
    """(problems, notes) for one Dockerfile: COPY sources exist and are in the context, plus the image contract."""
    from dockerfile_parse import DockerfileParser

    problems: list[str] = []
    notes: list[str] = []
    stem = path.name.removesuffix(".Dockerfile")
    parser = DockerfileParser(path=str(path))
    instructions = parser.structure
    ignore_file = path.with_name(path.name + ".dockerignore")
    patterns = []
    if ignore_file.exists():
        patterns = [
            ln.strip() for ln in ignore_file.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")
        ]
    stages = []
    for instruction in instructions:
        kind, value = instruction["instruction"], instruction["value"]
        if kind == "FROM":
            words = value.split()
            if len(words) == 3 and words[1].upper() == "AS":
                stages.append(words[2])
        if kind not in ("COPY", "ADD"):
            continue
        args = _instruction_args(value)
        flags = [a for a in args if a.startswith("--")]
        rest = [a for a in args if not a.startswith("--")]
        sources = rest[:-1]
        from_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
        if from_stage is not None:
            if from_stage not in stages:
                problems.append(
                    f"{path.name}:{instruction['startline'] + 1}: COPY --from={from_stage}: no such earlier stage"
                )
            continue
        for source in sources:
            relative = os.path.normpath(source)
            if not any(REPO_ROOT.glob(relative)) and not (REPO_ROOT / relative).exists():
                problems.append(
                    f"{path.name}:{instruction['startline'] + 1}: COPY source {source} does not exist in the repository"
                )
            elif dockerignore_excludes(patterns, relative):
                problems.append(
                    f"{path.name}:{instruction['startline'] + 1}: COPY source {source} is excluded by {ignore_file.name}"
                )

    if stem not in IMAGES:
        problems.append(f"{path.name}: unknown image (expected one of {', '.join(IMAGES)})")
        return problems, notes
    component, extra = IMAGES[stem]
    port = int(load_values_file(CHART_DIR / "values.yaml")[component]["port"])
    text = path.read_text()
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
    if not entrypoints or _instruction_args(entrypoints[-1]) != ["voicemesh", "serve", component]:
        problems.append(f"{path.name}: ENTRYPOINT is not voicemesh serve {component}")
    pyproject = REPO_ROOT / "pyproject.toml"
    if pyproject.exists():
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        extras = project.get("optional-dependencies", {})
        if extra not in extras:
            problems.append(f'{path.name}: pyproject.toml has no extra "{extra}" (pip install ".[{extra}]" would fail)')
        tools = [r for r in extras.get("dev", []) if re.match(r"grpcio-tools\s*==", r)]
        pinned = re.search(r"ARG GRPCIO_TOOLS_VERSION=(\S+)", text)
        if tools and pinned and tools[0].split("==", 1)[1].strip() != pinned.group(1):
            problems.append(
                f"{path.name}: GRPCIO_TOOLS_VERSION={pinned.group(1)} differs from pyproject's dev extra {tools[0]}"
            )
    if stem == "llm" and "CMAKE_ARGS=-DGGML_NATIVE=OFF" not in text:
        problems.append(f"{path.name}: llama.cpp must build with CMAKE_ARGS=-DGGML_NATIVE=OFF")
    notes.append(
        f"{path.name}: {len(froms)} stages, extra [{extra}], user {users[-1] if users else '-'}, health port {port}"
    )
    return problems, notes


# ---------------------------------------------------------------------------------------------------------
# checkov


def load_checkov_skips(path: Path = CHECKOV_SKIPS) -> dict[str, dict[str, Any]]:
    """check id -> {reason, resources (optional list of fnmatch patterns on checkov's resource id)}."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    skips = {}
    for entry in data.get("skips", []):
        if not entry.get("reason", "").strip():
            raise ValueError(f"{path.name}: {entry.get('id')} has no reason")
        skips[entry["id"]] = entry
    return skips


def checkov_executable() -> str:
    beside = Path(sys.executable).with_name("checkov")
    found = str(beside) if beside.exists() else shutil.which("checkov")
    if not found:
        raise FileNotFoundError("checkov is not installed (pip install -r deploy/k8s/requirements.txt)")
    return found


def run_checkov(directories: list[Path]) -> list[dict[str, Any]]:
    """checkov --framework kubernetes dockerfile --skip-download over directories; returns its JSON reports."""
    command = [
        checkov_executable(),
        "--framework",
        "kubernetes",
        "dockerfile",
        "--skip-download",
        "--compact",
        "-o",
        "json",
    ]
    for directory in directories:
        command += ["-d", str(directory)]
    environment = dict(os.environ, BC_SKIP_MAPPING="TRUE", CHECKOV_NO_OUTPUT="", PYTHONWARNINGS="ignore")
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
    # With several -d, checkov prints more than one JSON value (a report, then the list of all reports).
    decoder, text, position, reports = json.JSONDecoder(), result.stdout, 0, []
    try:
        while position < len(text):
            if text[position].isspace():
                position += 1
                continue
            value, position = decoder.raw_decode(text, position)
            reports += value if isinstance(value, list) else [value]
    except json.JSONDecodeError:
        raise RuntimeError(
            f"checkov exited {result.returncode} without JSON:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        ) from None
    if not reports:
        raise RuntimeError(f"checkov exited {result.returncode} with no report:\n{result.stderr[-2000:]}")
    return reports


def classify_checkov(reports: list[dict[str, Any]], skips: dict[str, dict[str, Any]]) -> Check:
    """Every failed check must be in the skip list (with its resource pattern, if any); stale skips are noted."""
    check = Check("checkov")
    passed = failed = 0
    accepted: Counter = Counter()
    seen: set[tuple[str, ...]] = set()
    frameworks: Counter = Counter()
    for report in reports:
        results = report.get("results", {})
        for error in results.get("parsing_errors", []) or []:
            check.failures.append(f"checkov could not parse {error}")
        for outcome in ("passed_checks", "failed_checks"):
            for finding in results.get(outcome, []):
                key = (
                    outcome,
                    finding["check_id"],
                    finding.get("file_abs_path", ""),
                    finding.get("resource", ""),
                    str(finding.get("file_line_range")),
                )
                if key in seen:
                    continue  # the same report printed twice
                seen.add(key)
                frameworks[report.get("check_type")] += 1
                if outcome == "passed_checks":
                    passed += 1
                else:
                    failed += 1
                    _classify_finding(finding, skips, accepted, check.failures)
    for check_id, entry in skips.items():
        reason = " ".join(entry["reason"].split())
        if accepted[check_id]:
            check.notes.append(f"skip {check_id} x{accepted[check_id]}: {reason}")
        else:
            check.notes.append(f"skip {check_id} (no finding now; stale?): {reason}")
    by_framework = ", ".join(f"{n} {k}" for k, n in sorted(frameworks.items()))
    check.summary = f"{passed} passed, {failed} failed of which {sum(accepted.values())} accepted by {CHECKOV_SKIPS.name} ({by_framework} results)"
    return check


def _classify_finding(
    finding: dict[str, Any], skips: dict[str, dict[str, Any]], accepted: Counter, failures: list[str]
) -> None:
    """Count a failed checkov finding as accepted (listed skip, resource in scope) or as a failure."""
    skip = skips.get(finding["check_id"])
    resource = finding.get("resource", "")
    scope = skip.get("resources") if skip else None
    if skip and (not scope or any(fnmatch.fnmatchcase(resource, p) for p in scope)):
        accepted[finding["check_id"]] += 1
        return
    failures.append(
        f"{finding['check_id']} {finding.get('check_name')}: {resource} in {finding.get('file_path')} (severity {finding.get('severity')})"
    )


# ---------------------------------------------------------------------------------------------------------
# Main


def run_all(keep: Path | None = None, with_checkov: bool = True) -> list[Check]:
    """Run every check; returns the results (printing nothing)."""
    results: list[Check] = []
    workdir = Path(tempfile.mkdtemp(prefix="voicemesh-k8s-check-"))
    try:
        started = time.monotonic()
        lint_inputs: dict[str, str] = {}
        defaults = load_values_file(CHART_DIR / "values.yaml")
        documented = Check("values.yaml documented", values_documentation_problems())
        documented.summary = "every field has a comment"
        results.append(documented)
        lint_inputs["values.yaml"] = (CHART_DIR / "values.yaml").read_text()
        for scenario, overlays in SCENARIOS.items():
            check = Check(f"render {scenario}")
            t0 = time.monotonic()
            for overlay in overlays:
                lint_inputs[overlay] = (CHART_DIR / overlay).read_text()
                check.failures += [
                    f"{overlay}: {p}" for p in unknown_keys(load_values_file(CHART_DIR / overlay), defaults)
                ]
            try:
                rendered = render(overlays, scenario=scenario)
            except Exception as error:  # a render error is a finding, not a crash
                check.failures.append(f"render failed: {error}")
                check.seconds = time.monotonic() - t0
                results.append(check)
                continue
            check.failures += lint_chart(overlays)
            validation, kinds = validate_objects(rendered.objects)
            check.failures += [f"schema: {f}" for f in validation]
            check.failures += [f"wiring: {p}" for p in wiring_problems(rendered)]
            manifests = manifest_files(rendered)
            check.failures += [
                f"yamllint: {p}" for p in lint_yaml({f"{scenario}/{n}": t for n, t in manifests.items()})
            ]
            out_dir = workdir / "rendered" / scenario
            out_dir.mkdir(parents=True)
            for name, text in manifests.items():
                (out_dir / name).write_text(text)
            check.summary = (
                f"{len(rendered.objects)} objects valid against Kubernetes {KUBERNETES_VERSION} (strict): "
                + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            )
            check.seconds = time.monotonic() - t0
            results.append(check)

        t0 = time.monotonic()
        values_lint = Check("yamllint values files", [f"yamllint: {p}" for p in lint_yaml(lint_inputs)])
        values_lint.summary = f"{len(lint_inputs)} files"
        values_lint.seconds = time.monotonic() - t0
        results.append(values_lint)

        t0 = time.monotonic()
        dockerfiles = Check("Dockerfiles")
        paths = sorted(IMAGES_DIR.glob("*.Dockerfile"))
        missing = sorted(set(IMAGES) - {p.name.removesuffix(".Dockerfile") for p in paths})
        dockerfiles.failures += [f"missing {name}.Dockerfile" for name in missing]
        for path in paths:
            problems, notes = dockerfile_problems(path)
            dockerfiles.failures += problems
            dockerfiles.notes += notes
        dockerfiles.summary = f"{len(paths)} Dockerfiles parsed, COPY sources checked against {REPO_ROOT}"
        dockerfiles.seconds = time.monotonic() - t0
        results.append(dockerfiles)

        if with_checkov:
            t0 = time.monotonic()
            try:
                scan = classify_checkov(run_checkov([workdir / "rendered", IMAGES_DIR]), load_checkov_skips())
            except Exception as error:
                scan = Check("checkov", [f"checkov did not run: {error}"])
            scan.seconds = time.monotonic() - t0
            results.append(scan)

        total = Check("total")
        total.seconds = time.monotonic() - started
        total.summary = f"{sum(1 for r in results if r.ok)}/{len(results)} checks passed"
        results.append(total)
        if keep is not None:
            shutil.copytree(workdir / "rendered", keep, dirs_exist_ok=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def print_results(results: list[Check]) -> None:
    for result in results:
        if result.name == "total":
            print(f"\n{result.summary} in {result.seconds:.1f} s")
            continue
        status = "PASS" if result.ok else "FAIL"
        print(f"{status} {result.name} ({result.seconds:.1f} s): {result.summary}")
        for note in result.notes:
            print(f"     - {note}")
        for failure in result.failures:
            print(f"     ! {failure}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="also write the rendered manifests under this directory")
    parser.add_argument("--no-checkov", action="store_true", help="skip the checkov scan (quick iterations only)")
    args = parser.parse_args(argv)
    print(
        f"voicemesh k8s check: chart {CHART_DIR.relative_to(REPO_ROOT)}, Kubernetes {KUBERNETES_VERSION}, release {RELEASE} in {NAMESPACE}"
    )
    results = run_all(keep=args.keep, with_checkov=not args.no_checkov)
    print_results(results)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
