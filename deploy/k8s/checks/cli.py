"""Run every offline check of the chart and images, print a report, exit 1 on any failure."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from . import keda, monitoring
from .dockerfiles import dockerfiles_check
from .lint import lint_yaml
from .policy import checkov_check
from .render import lint_chart, load_values_file, manifest_files, render
from .results import Check
from .schema import validate_objects
from .settings import CHART_DIR, IMAGES_DIR, KUBERNETES_VERSION, NAMESPACE, RELEASE, REPO_ROOT, SCENARIOS
from .values import unknown_keys, values_documentation_problems
from .wiring import wiring_problems

DESCRIPTION = "Offline checks of the Kubernetes deployment: the Helm chart and the service images."


def scenario_check(scenario: str, overlays: tuple[str, ...], out_dir: Path) -> Check:
    """One values scenario: overlay keys, render, helm lint, schemas, wiring, yamllint; manifests go to out_dir."""
    check = Check(f"render {scenario}")
    defaults = load_values_file(CHART_DIR / "values.yaml")
    for overlay in overlays:
        check.failures += [f"{overlay}: {p}" for p in unknown_keys(load_values_file(CHART_DIR / overlay), defaults)]
    try:
        rendered = render(overlays, scenario=scenario)
    except Exception as error:  # a render error is a finding, not a crash
        check.failures.append(f"render failed: {error}")
        return check
    check.failures += lint_chart(overlays)
    validation, kinds = validate_objects(rendered.objects)
    check.failures += [f"schema: {f}" for f in validation]
    check.failures += [f"wiring: {p}" for p in wiring_problems(rendered)]
    check.failures += [f"monitoring: {p}" for p in monitoring.monitoring_problems(rendered)]
    manifests = manifest_files(rendered)
    check.failures += [f"yamllint: {p}" for p in lint_yaml({f"{scenario}/{n}": t for n, t in manifests.items()})]
    out_dir.mkdir(parents=True)
    for name, text in manifests.items():
        (out_dir / name).write_text(text)
    against = f"Kubernetes {KUBERNETES_VERSION}" + (f", KEDA {keda.KEDA_VERSION}" if kinds[keda.KIND] else "")
    if kinds["PrometheusRule"] or kinds["PodMonitor"]:
        against += f", Prometheus Operator {monitoring.OPERATOR_VERSION}"
    check.summary = f"{len(rendered.objects)} objects valid against {against} (strict): " + ", ".join(
        f"{n} {k}" for k, n in sorted(kinds.items())
    )
    return check


def _timed(run: Callable[[], Check]) -> Check:
    """run(), with the seconds it took recorded on its result."""
    started = time.monotonic()
    check = run()
    check.seconds = time.monotonic() - started
    return check


def run_all(keep: Path | None = None, with_checkov: bool = True) -> list[Check]:
    """Run every check; returns the results (printing nothing), the last one a "total"."""
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="voicemesh-k8s-check-"))
    try:
        results = [_timed(values_documentation_check)]
        for scenario, overlays in SCENARIOS.items():
            out_dir = workdir / "rendered" / scenario
            results.append(_timed(lambda s=scenario, o=overlays, d=out_dir: scenario_check(s, o, d)))
        results.append(_timed(values_lint_check))
        results.append(_timed(monitoring.generated_files_check))
        results.append(_timed(monitoring.promtool_check))
        results.append(_timed(dockerfiles_check))
        if with_checkov:
            results.append(_timed(lambda: checkov_check([workdir / "rendered", IMAGES_DIR])))
        total = Check("total")
        total.seconds = time.monotonic() - started
        total.summary = f"{sum(1 for r in results if r.ok)}/{len(results)} checks passed"
        results.append(total)
        if keep is not None:
            shutil.copytree(workdir / "rendered", keep, dirs_exist_ok=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def values_documentation_check() -> Check:
    """Every field of values.yaml has a comment."""
    check = Check("values.yaml documented", values_documentation_problems())
    check.summary = "every field has a comment"
    return check


def values_lint_check() -> Check:
    """yamllint over values.yaml and every scenario's overlay files."""
    names = ["values.yaml", *(overlay for overlays in SCENARIOS.values() for overlay in overlays)]
    documents = {name: (CHART_DIR / name).read_text() for name in dict.fromkeys(names)}
    check = Check("yamllint values files", [f"yamllint: {p}" for p in lint_yaml(documents)])
    check.summary = f"{len(documents)} files"
    return check


def print_results(results: list[Check]) -> None:
    """One line per check (PASS/FAIL, time, summary), its notes (-) and failures (!), then the total."""
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
    """The command line of deploy/k8s/check.py; returns the exit status."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--keep", type=Path, help="also write the rendered manifests under this directory")
    parser.add_argument("--no-checkov", action="store_true", help="skip the checkov scan (quick iterations only)")
    args = parser.parse_args(argv)
    print(
        f"voicemesh k8s check: chart {CHART_DIR.relative_to(REPO_ROOT)}, Kubernetes {KUBERNETES_VERSION},"
        f" release {RELEASE} in {NAMESPACE}"
    )
    results = run_all(keep=args.keep, with_checkov=not args.no_checkov)
    print_results(results)
    return 0 if all(r.ok for r in results) else 1
