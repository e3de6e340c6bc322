"""A real Prometheus and a real OpenTelemetry collector beside a local mesh (`voicemesh up --observe`, the tests):
Prometheus scrapes each process with its metrics token and evaluates the chart's rules (rules.yml here, generated
from deploy/k8s); the collector (rotel, from PyPI) receives every process's spans over OTLP/gRPC."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voicemesh.mesh import free_port

HERE = Path(__file__).resolve().parent
RULES_FILE = HERE / "rules.yml"
"""The chart's PrometheusRule (default values) as a plain rule file."""
QUERIES_FILE = HERE / "queries.json"
"""The Grafana dashboard's panel queries, with its variables as a bare Prometheus needs them."""
UNAUTHENTICATED_JOB = "voicemesh-gateway-without-token"


@dataclass(frozen=True)
class Target:
    """One process's /metrics: where, and the bearer token it wants ("" = none)."""

    component: str
    address: str
    token: str = ""


def prometheus_binary() -> str | None:
    """Debian's `prometheus` (apt-get install prometheus), if installed."""
    return shutil.which("prometheus")


def collector_binary() -> str | None:
    """The rotel collector's binary, shipped inside the `rotel` wheel (the `observe` extra), if installed."""
    spec = importlib.util.find_spec("rotel")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "rotel-agent"
    return str(binary) if binary.exists() else None


def dashboard_queries() -> list[dict[str, str]]:
    """[{panel, expr}] of every query of the chart's dashboard."""
    queries: list[dict[str, str]] = json.loads(QUERIES_FILE.read_text())
    return queries


def recording_rules() -> list[str]:
    """The series the rules record, in file order (read without a YAML parser: one `- record: NAME` a line)."""
    names = []
    for line in RULES_FILE.read_text().splitlines():
        key, _, value = line.strip().removeprefix("- ").partition(": ")
        if key == "record" and value not in names:
            names.append(value)
    return names


def prometheus_config(
    targets: list[Target], directory: Path, interval_s: float = 1.0, unauthenticated: str = ""
) -> Path:
    """Write prometheus.yml (JSON is YAML): one job per component, labelled `component` as the chart's PodMonitors
    label it, each with its token in a file; with `unauthenticated`, also a job that scrapes that address without
    one, to show what a wrong scrape looks like (a down target, not an empty dashboard)."""
    jobs: list[dict[str, Any]] = []
    for target in targets:
        job: dict[str, Any] = {
            "job_name": f"voicemesh-{target.component}",
            "static_configs": [{"targets": [target.address], "labels": {"component": target.component}}],
        }
        if target.token:
            token_file = directory / f"{target.component}.token"
            token_file.write_text(target.token)
            token_file.chmod(0o600)
            job["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        jobs.append(job)
    if unauthenticated:
        jobs.append({"job_name": UNAUTHENTICATED_JOB, "static_configs": [{"targets": [unauthenticated]}]})
    config = {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
        "rule_files": [str(RULES_FILE)],
        "scrape_configs": jobs,
    }
    path = directory / "prometheus.yml"
    path.write_text(json.dumps(config, indent=2))
    return path


def start_prometheus(config: Path, directory: Path, port: int) -> subprocess.Popen[bytes]:
    """Prometheus on 127.0.0.1:`port` with `config`, its data and log in `directory`."""
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError("prometheus is not installed (Debian: apt-get install prometheus)")
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    with open(directory / "prometheus.log", "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def start_collector(directory: Path, grpc_port: int, http_port: int, forward_to: str = "") -> subprocess.Popen[bytes]:
    """rotel receiving OTLP on 127.0.0.1 (gRPC `grpc_port`, HTTP `http_port`). It forwards the spans over OTLP/gRPC
    to `forward_to` (an operator's backend, or a test's receiver), or else logs them to collector.log."""
    binary = collector_binary()
    if binary is None:
        raise FileNotFoundError("the rotel collector is not installed (pip install 'voicemesh[observe]')")
    argv = [
        binary,
        "start",
        f"--otlp-grpc-endpoint=127.0.0.1:{grpc_port}",
        f"--otlp-http-endpoint=127.0.0.1:{http_port}",
        f"--pid-file={directory / 'collector.pid'}",
        f"--log-file={directory / 'collector.log'}",
    ]
    if forward_to:
        argv += ["--exporter=otlp", f"--otlp-exporter-endpoint={forward_to}", "--otlp-exporter-protocol=grpc"]
    else:
        argv += ["--exporter=blackhole", "--debug-log=traces"]
    with open(directory / "collector.log", "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def query(base_url: str, expr: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """An instant query's result vector (raises on an API error)."""
    url = f"{base_url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"query {expr!r} failed: {body.get('error')}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def targets(base_url: str) -> list[dict[str, Any]]:
    """Prometheus's active scrape targets (job, health, lastError...)."""
    with urllib.request.urlopen(f"{base_url}/api/v1/targets", timeout=5) as response:
        active: list[dict[str, Any]] = json.load(response)["data"]["activeTargets"]
    return active


def wait_ready(base_url: str, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Until Prometheus answers /-/ready; raises if it exits or takes longer."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}; see its log")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base_url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"prometheus at {base_url} not ready after {timeout_s:.0f} s")
        time.sleep(0.2)


def graph_url(base_url: str, queries: list[dict[str, str]]) -> str:
    """A Prometheus graph page with the dashboard's queries, one panel each."""
    params: dict[str, str] = {}
    for index, item in enumerate(queries):
        params[f"g{index}.expr"] = item["expr"]
        params[f"g{index}.tab"] = "0"
        params[f"g{index}.range_input"] = "15m"
    return f"{base_url}/graph?{urllib.parse.urlencode(params)}"


def stop(processes: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM each, then SIGKILL what is left after 10 s."""
    for process in processes.values():
        if process.poll() is None:
            process.terminate()
    for process in processes.values():
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def stopping(processes: dict[str, subprocess.Popen[bytes]]) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Stop every process put in `processes` on the way out."""
    try:
        yield processes
    finally:
        stop(processes)


class Observers:
    """`voicemesh up --observe`: the collector before the mesh starts (its processes read OTEL_* from the
    environment), Prometheus once the mesh serves; `lines` says where to look, or what to install."""

    def __init__(self, prometheus_port: int, otlp_port: int) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="voicemesh-observe-"))
        self.prometheus_port = prometheus_port
        self.otlp_port = otlp_port
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.lines: list[str] = []

    def before_mesh(self) -> dict[str, str]:
        """Start the collector if installed; returns the environment the mesh's processes need to reach it."""
        if collector_binary() is None:
            self.lines.append("traces:      no collector installed (pip install 'voicemesh[observe]')")
            return {}
        self.processes["collector"] = start_collector(self.directory, self.otlp_port, free_port())
        self.lines.append(
            f"traces:      OTLP/gRPC to rotel on 127.0.0.1:{self.otlp_port}; each span in {self.directory}/collector.log"
        )
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.otlp_port}"}

    def after_mesh(self, targets: list[Target]) -> None:
        """Start Prometheus on the mesh's /metrics (if installed) and wait until it answers."""
        if prometheus_binary() is None:
            self.lines.append("metrics:     no Prometheus installed (Debian: apt-get install prometheus)")
            return
        config = prometheus_config(targets, self.directory, interval_s=5.0)
        self.processes["prometheus"] = start_prometheus(config, self.directory, self.prometheus_port)
        base = f"http://127.0.0.1:{self.prometheus_port}"
        try:
            wait_ready(base, self.processes["prometheus"])
        except (RuntimeError, TimeoutError) as error:  # e.g. its port is taken: the mesh runs on without it
            self.lines.append(f"metrics:     Prometheus did not start ({error}): {self.directory}/prometheus.log")
            return
        self.lines += [
            f"dashboard:   {graph_url(base, dashboard_queries())}",
            f"alerts:      {base}/alerts  (rules: the chart's, from {RULES_FILE})",
            f"targets:     {base}/targets",
        ]

    def stop(self) -> None:
        stop(self.processes)
