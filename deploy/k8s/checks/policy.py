"""checkov over the rendered manifests and the Dockerfiles: a finding fails unless checkov-skips.yaml explains it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import yaml

from .results import Check
from .settings import CHECKOV_SKIPS

Finding = dict[str, Any]


def load_checkov_skips(path: Path = CHECKOV_SKIPS) -> dict[str, dict[str, Any]]:
    """check id -> {reason, resources (optional list of fnmatch patterns on checkov's resource id)}."""
    data = yaml.safe_load(path.read_text()) or {}
    skips = {}
    for entry in data.get("skips", []):
        if not entry.get("reason", "").strip():
            raise ValueError(f"{path.name}: {entry.get('id')} has no reason")
        skips[entry["id"]] = entry
    return skips


def checkov_executable() -> str:
    """checkov beside this Python (its venv), else on PATH."""
    beside = Path(sys.executable).with_name("checkov")
    found = str(beside) if beside.exists() else shutil.which("checkov")
    if not found:
        raise FileNotFoundError("checkov is not installed (pip install -r deploy/k8s/requirements.txt)")
    return found


def run_checkov(directories: list[Path]) -> list[dict[str, Any]]:
    """checkov --framework kubernetes dockerfile --skip-download over directories; returns its JSON reports."""
    command = [checkov_executable(), "--framework", "kubernetes", "dockerfile", "--skip-download", "--compact"]
    command += ["-o", "json"]
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
    accepted: Counter[str] = Counter()
    seen: set[tuple[str, ...]] = set()
    frameworks: Counter[str] = Counter()
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
    check.summary = (
        f"{passed} passed, {failed} failed of which {sum(accepted.values())} accepted by {CHECKOV_SKIPS.name}"
        f" ({by_framework} results)"
    )
    return check


def _classify_finding(
    finding: Finding, skips: dict[str, dict[str, Any]], accepted: Counter[str], failures: list[str]
) -> None:
    """Count a failed checkov finding as accepted (listed skip, resource in scope) or as a failure."""
    skip = skips.get(finding["check_id"])
    resource = finding.get("resource", "")
    scope = skip.get("resources") if skip else None
    if skip and (not scope or any(fnmatchcase(resource, p) for p in scope)):
        accepted[finding["check_id"]] += 1
        return
    failures.append(
        f"{finding['check_id']} {finding.get('check_name')}: {resource} in {finding.get('file_path')}"
        f" (severity {finding.get('severity')})"
    )


def checkov_check(directories: list[Path]) -> Check:
    """Run checkov and classify its findings; a checkov that cannot run is a failure, not a crash."""
    try:
        return classify_checkov(run_checkov(directories), load_checkov_skips())
    except Exception as error:
        return Check("checkov", [f"checkov did not run: {error}"])
