"""Monitoring objects: the Prometheus Operator's PodMonitor and PrometheusRule against its CRDs, every PromQL query
the chart ships (rules, dashboard, KEDA triggers) against the metrics the code exports, the generated files
(dashboard JSON, the local rules and queries) against their sources, and promtool on the rules.

The CRD schemas come from cloudcoil-models-prometheus-operator (PyPI, Apache-2.0; generated from the operator's
CRDs, versioned as its release plus one digit), made strict as keda.py does for KEDA's. Queries are parsed with
promql-parser (PyPI, the Rust parser GreptimeDB uses), not with regular expressions.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jsonschema
import promql_parser
import yaml
from cloudcoil.models.prometheus_operator import v1 as operator
from jsonschema.protocols import Validator

from . import dashboard
from .keda import strict_schema
from .render import Rendered, render
from .results import Check
from .settings import CREDENTIALS, K8S_DIR, REPO_ROOT

API_VERSION = "monitoring.coreos.com/v1"
OPERATOR_VERSION = ".".join(version("cloudcoil.models.prometheus_operator").split(".")[:3])
_MODELS = {"PodMonitor": operator.PodMonitor, "PrometheusRule": operator.PrometheusRule}
#: What the CRDs do not say but a chart never does: only these metadata fields, and no status.
_CHART_RULES: dict[str, Any] = {
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "metadata": {"required": ["name"], "propertyNames": {"enum": ["name", "namespace", "labels", "annotations"]}},
        "status": False,
    },
}

#: The overlay that turns every monitoring object on (with check-only labels), applied over a scenario.
OVERLAY = "ci/values-observability.yaml"
#: Where the code defines its metrics (generated stubs excluded).
SOURCE_DIRS = ("voicemesh", "gateway", "services")
_SERIES = {
    "Counter": ("_total", "_created"),
    "Gauge": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "Summary": ("", "_sum", "_count", "_created"),
    "Info": ("_info",),
}
#: Series Prometheus itself writes for every target and alert.
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped", "ALERTS", "ALERTS_FOR_STATE"})

LOCAL_DIR = REPO_ROOT / "voicemesh" / "observe"
LOCAL_RULES = LOCAL_DIR / "rules.yml"
LOCAL_QUERIES = LOCAL_DIR / "queries.json"
PROMTOOL_TESTS = K8S_DIR / "promtool" / "alerts-test.yml"


def validators() -> dict[tuple[str, str], Callable[[], Validator]]:
    """(apiVersion, kind) -> its strict validator, for schema.CUSTOM_RESOURCES."""
    return {(API_VERSION, kind): (lambda k=kind: validator(k)) for kind in _MODELS}


def _python_patterns(schema: Any) -> Any:
    """The schema with Go's `^(?i)...` patterns (the CRD's partial_response_strategy) as Python's `(?i)^...`: Python
    takes an inline flag only at the start."""
    if isinstance(schema, dict):
        return {
            key: value.replace("^(?i)", "(?i)^")
            if key == "pattern" and isinstance(value, str)
            else _python_patterns(value)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_python_patterns(item) for item in schema]
    return schema


@cache
def validator(kind: str) -> Validator:
    crd = strict_schema(_python_patterns(_MODELS[kind].model_json_schema(by_alias=True, mode="validation")))
    definitions = crd.pop("$defs", {})
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": definitions,
        "allOf": [crd, _CHART_RULES],
    }
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _metric_definitions(root: Path) -> Iterator[tuple[str, str, ast.Call]]:
    """(metric type, name, the call) of every prometheus_client metric defined under SOURCE_DIRS."""
    for directory in SOURCE_DIRS:
        for path in sorted((root / directory).rglob("*.py")):
            if "v1" in path.relative_to(root).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call) or len(node.args) < 2:
                    continue
                func = node.func
                kind = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                first = node.args[0]
                if kind in _SERIES and isinstance(first, ast.Constant) and isinstance(first.value, str):
                    yield kind, first.value, node


@cache
def exported_metrics(root: Path = REPO_ROOT) -> frozenset[str]:
    """Every series name the code's metrics export (a Counter `x_total` as x_total and x_created, a Histogram as
    x_bucket, x_sum, x_count...), read from the source without importing it."""
    names: set[str] = set()
    for kind, name, _ in _metric_definitions(root):
        base = name.removesuffix("_total") if kind == "Counter" else name
        names.update(base + suffix for suffix in _SERIES[kind])
    return frozenset(names)


@cache
def histogram_buckets(root: Path = REPO_ROOT) -> frozenset[str]:
    """The `le` values the code's histograms export, as the scrape writes them (LATENCY_BUCKETS_S and +Inf)."""
    tree = ast.parse((root / "voicemesh" / "telemetry.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LATENCY_BUCKETS_S" for t in node.targets):
            return frozenset({*(repr(float(v)) for v in ast.literal_eval(node.value)), "+Inf"})
    raise LookupError("LATENCY_BUCKETS_S not found in voicemesh/telemetry.py")


def _selectors(node: Any) -> Iterator[Any]:
    """Every VectorSelector in a parsed PromQL expression."""
    if isinstance(node, promql_parser.VectorSelector):
        yield node
    elif isinstance(node, promql_parser.MatrixSelector):
        yield node.vector_selector
    elif isinstance(node, promql_parser.Call):
        for arg in node.args:
            yield from _selectors(arg)
    elif isinstance(node, promql_parser.BinaryExpr):
        yield from _selectors(node.lhs)
        yield from _selectors(node.rhs)
    elif isinstance(node, promql_parser.AggregateExpr):
        yield from _selectors(node.expr)
        if node.param is not None:
            yield from _selectors(node.param)
    elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        yield from _selectors(node.expr)


def _metric_name(selector: Any) -> str:
    if selector.name:
        return str(selector.name)
    for matcher in selector.matchers.matchers:
        if matcher.name == "__name__":
            return str(matcher.value)
    return ""


def query_problems(where: str, expr: str, known: frozenset[str]) -> list[str]:
    """What is wrong with one query: it does not parse, names a series outside `known`, or asks a histogram for a
    bucket boundary it does not have."""
    try:
        parsed = promql_parser.parse(expr)
    except (ValueError, RuntimeError) as error:
        return [f"{where}: does not parse ({error}): {expr}"]
    problems = []
    for selector in _selectors(parsed):
        name = _metric_name(selector)
        if name not in known:
            problems.append(
                f"{where}: {name or '(no metric name)'} is neither a metric the code exports ({', '.join(SOURCE_DIRS)})"
                " nor a recording rule of the chart"
            )
        if name.endswith("_bucket"):
            for matcher in selector.matchers.matchers:
                if matcher.name == "le" and matcher.value not in histogram_buckets():
                    problems.append(f"{where}: {name} has no bucket le={matcher.value!r}")
    return problems


def prometheus_rules(rendered: Rendered) -> list[dict[str, Any]]:
    """The rule groups of the release's PrometheusRules."""
    return [
        group
        for obj in rendered.objects
        if obj.get("kind") == "PrometheusRule"
        for group in obj.get("spec", {}).get("groups", [])
    ]


def shipped_queries(rendered: Rendered) -> list[tuple[str, str]]:
    """(where, PromQL) of every query a release ships: rules, dashboard panels, KEDA triggers."""
    found = []
    for group in prometheus_rules(rendered):
        for rule in group.get("rules", []):
            found.append((f"rule {rule.get('record') or rule.get('alert')}", str(rule["expr"])))
    for obj in rendered.objects:
        if obj.get("kind") == "ConfigMap":
            for key, text in (obj.get("data") or {}).items():
                if key.endswith(".json") and '"panels"' in text:
                    model = json.loads(text)
                    found += [
                        (f"dashboard panel {title!r}", dashboard.for_prometheus(expr))
                        for title, expr in dashboard.panel_queries(model)
                    ]
        elif obj.get("kind") == "ScaledObject":
            for trigger in obj["spec"].get("triggers", []):
                if trigger.get("type") == "prometheus":
                    found.append((f"ScaledObject {obj['metadata']['name']}", trigger["metadata"]["query"]))
    return found


@cache
def chart_recordings() -> frozenset[str]:
    """Every series the chart's recording rules write (rendered with everything on)."""
    groups = prometheus_rules(render([CREDENTIALS, OVERLAY], scenario="recordings"))
    return frozenset(rule["record"] for group in groups for rule in group["rules"] if "record" in rule)


def monitoring_problems(rendered: Rendered) -> list[str]:
    """Every shipped query of a release names only exported metrics or the chart's recordings."""
    known = exported_metrics() | chart_recordings() | PROMETHEUS_SERIES
    return [problem for where, expr in shipped_queries(rendered) for problem in query_problems(where, expr, known)]


def generated_files() -> dict[Path, str]:
    """What deploy/k8s/observability.py writes: the dashboard JSON, and for `voicemesh up --observe` the chart's
    rules as a plain rule file and the dashboard's queries as a bare Prometheus asks them."""
    rendered = render([CREDENTIALS], set_values={"metrics": {"prometheusRule": {"enabled": True}}}, scenario="local")
    rules = "# Generated by deploy/k8s/observability.py from the chart's PrometheusRule (default values).\n"
    rules += yaml.safe_dump({"groups": prometheus_rules(rendered)}, sort_keys=False, width=120)
    model = dashboard.build()
    queries = [
        {"panel": title, "expr": dashboard.for_prometheus(expr)} for title, expr in dashboard.panel_queries(model)
    ]
    return {
        dashboard.DASHBOARD_FILE: dashboard.render_json(),
        LOCAL_RULES: rules,
        LOCAL_QUERIES: json.dumps(queries, indent=2) + "\n",
    }


def generated_files_check() -> Check:
    """The committed generated files match what their sources make now."""
    check = Check("generated monitoring files")
    files = generated_files()
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            check.failures.append(
                f"{path.relative_to(REPO_ROOT)} is stale: run .venv-k8s/bin/python deploy/k8s/observability.py --write"
            )
    check.summary = f"{len(files)} files up to date"
    return check


def promtool_check(overlays: tuple[str, ...] = ("ci/values-secure.yaml", OVERLAY)) -> Check:
    """`promtool check rules` and `promtool test rules` (promtool/alerts-test.yml: each alert fires and clears) on
    the rules of a release with TLS on, so that every alert is there."""
    check = Check("promtool")
    promtool = shutil.which("promtool")
    if promtool is None:
        check.notes.append("promtool missing (Debian: apt-get install prometheus; make test does): not run")
        check.summary = "skipped"
        return check
    groups = prometheus_rules(render(overlays, scenario="promtool"))
    with tempfile.TemporaryDirectory(prefix="voicemesh-promtool-") as directory:
        rules = Path(directory) / "rules.yml"
        rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        tests = Path(directory) / PROMTOOL_TESTS.name
        shutil.copyfile(PROMTOOL_TESTS, tests)
        for argv in ([promtool, "check", "rules", str(rules)], [promtool, "test", "rules", str(tests)]):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
            if done.returncode != 0:
                output = (done.stdout + done.stderr).strip().replace(directory + "/", "")
                check.failures.append(f"{' '.join(argv[1:3])}: {output[-2000:]}")
    rules_count = sum(len(group["rules"]) for group in groups)
    check.summary = f"{rules_count} rules valid; alert unit tests in {PROMTOOL_TESTS.relative_to(REPO_ROOT)} pass"
    return check
