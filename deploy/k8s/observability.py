"""Write the monitoring files generated from their sources: the chart's Grafana dashboard (built with
grafana-foundation-sdk in checks/dashboard.py) and, for `voicemesh up --observe`, the chart's rules as a plain rule
file and the dashboard's queries. `make k8s-check` fails while a committed copy is stale.

    python deploy/k8s/observability.py           # say which files are stale (exit 1 if any)
    python deploy/k8s/observability.py --write   # rewrite them
"""

from __future__ import annotations

import argparse
import sys

try:
    from checks.monitoring import generated_files
    from checks.settings import REPO_ROOT
except ModuleNotFoundError as error:  # the tools live in their own venv
    sys.exit(f"{error.name} is not installed: pip install -r deploy/k8s/requirements.txt ({error})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale files")
    args = parser.parse_args()
    stale = 0
    for path, text in generated_files().items():
        if path.exists() and path.read_text() == text:
            continue
        stale += 1
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        print(f"{'wrote' if args.write else 'stale'}: {path.relative_to(REPO_ROOT)}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
