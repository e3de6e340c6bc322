"""The Grafana dashboard, as code (grafana-foundation-sdk): built here, written to the chart's
files/grafana-dashboard.json by deploy/k8s/observability.py, whose check fails when the file is stale.

Panels read the chart's recording rules (templates/prometheusrule.yaml), so the dashboard, the alerts and the KEDA
triggers agree on what p99 means.
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders.dashboard import Dashboard as DashboardBuilder
from grafana_foundation_sdk.builders.dashboard import DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from .settings import CHART_DIR

DASHBOARD_FILE = CHART_DIR / "files" / "grafana-dashboard.json"
UID = "voicemesh-overview"
NS = 'namespace=~"$namespace"'
#: Grafana's variables, as a Prometheus without Grafana reads them (the local `voicemesh up --observe`, checks).
VARIABLES = {"$namespace": ".*", "$__rate_interval": "5m"}
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

# (row, [(panel title, unit, [(query, legend)])]): each panel a time series.
PANELS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Voice-to-voice",
        [
            (
                "V2V p50 / p95 / p99",
                "s",
                [(f"voicemesh:turn_v2v_seconds:p{q}_rate5m{{{NS}}}", f"p{q}") for q in ("50", "95", "99")],
            ),
            (
                "Turns over the V2V objective",
                "percentunit",
                [
                    (f"voicemesh:turn_v2v_slo_errors:ratio_rate{window}{{{NS}}}", f"last {window}")
                    for window in ("5m", "1h", "6h")
                ],
            ),
        ],
    ),
    (
        "Where the time goes",
        [
            (
                "Stage split p99 (upload / queue / compute / downlink)",
                "s",
                [(f"voicemesh:turn_stage_seconds:p99_rate5m{{{NS}}}", "{{stage}}")],
            ),
            (
                "Queue and compute p99 per stage",
                "s",
                [
                    (f"voicemesh:queue_wait_seconds:p99_rate5m{{{NS}}}", "{{service}} queue"),
                    (f"voicemesh:compute_seconds:p99_rate5m{{{NS}}}", "{{service}} compute"),
                ],
            ),
        ],
    ),
    (
        "Sessions and admission",
        [
            (
                "Sessions",
                "short",
                [
                    (f"voicemesh:active_sessions:sum{{{NS}}}", "open"),
                    (
                        f"sum by (transport) (rate(voicemesh_sessions_total{{{NS}}}[$__rate_interval])) * 60",
                        "started/min {{transport}}",
                    ),
                ],
            ),
            (
                "Calls, refusals and waiting requests",
                "short",
                [
                    (f"voicemesh:requests:rate5m{{{NS}}}", "{{component}} calls/s"),
                    (f"voicemesh:refusals:ratio_rate5m{{{NS}}}", "{{component}} refused (ratio)"),
                    (f"voicemesh:waiting_requests:sum{{{NS}}}", "{{service}} waiting"),
                ],
            ),
        ],
    ),
    (
        "Engines",
        [
            (
                "LLM batch occupancy",
                "percentunit",
                [(f"voicemesh:llm_batch_occupancy:ratio{{{NS}}}", "occupied slots")],
            ),
            ("LLM tokens per second", "short", [(f"voicemesh:llm_completion_tokens:rate5m{{{NS}}}", "tokens/s")]),
            (
                "ASR and TTS real-time factor",
                "short",
                [(f"voicemesh:real_time_factor:ratio_rate5m{{{NS}}}", "{{service}} (compute s per audio s)")],
            ),
        ],
    ),
    (
        "Failures",
        [
            ("Failovers by stage", "short", [(f"voicemesh:failovers:rate5m{{{NS}}}", "{{stage}}/s")]),
            (
                "Errors by stage",
                "short",
                [(f"voicemesh:errors:ratio_rate5m{{{NS}}}", "{{component}} error ratio")],
            ),
            ("Serving replicas", "short", [(f"voicemesh:serving_replicas:sum{{{NS}}}", "{{component}}")]),
        ],
    ),
]


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    dashboard = (
        DashboardBuilder("voicemesh")
        .uid(UID)
        .tags(["voicemesh"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            QueryVariable("namespace")
            .label("Namespace")
            .datasource(DATASOURCE)
            .query("label_values(voicemesh_serving, namespace)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .all_value(".*")
        )
    )
    for row, panels in PANELS:
        dashboard = dashboard.with_row(Row(row))
        for title, unit, queries in panels:
            panel = Timeseries().title(title).unit(unit).datasource(DATASOURCE).height(8).span(12)
            for index, (expr, legend) in enumerate(queries):
                panel = panel.with_target(
                    Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + index)).datasource(DATASOURCE)
                )
            dashboard = dashboard.with_panel(panel)
    encoded: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True, indent=2).encode(dashboard.build()))
    return encoded


def render_json() -> str:
    """The file's content: the dashboard's JSON, stable key order, a final newline."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def panel_queries(model: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query in a dashboard's JSON model."""
    return [
        (panel.get("title", ""), target["expr"])
        for panel in model.get("panels", [])
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def for_prometheus(expr: str) -> str:
    """A panel's query with Grafana's variables replaced as a bare Prometheus needs them."""
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr
