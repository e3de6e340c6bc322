"""Offline checks of the Kubernetes deployment (Helm chart, service images); the checks live in checks/.

    python deploy/k8s/check.py            # everything; exit status 1 on any failure
    python deploy/k8s/check.py --keep D   # also leave the rendered manifests in D
    python deploy/k8s/check.py --no-checkov

Tools: deploy/k8s/requirements.txt (`make k8s-check` installs them into .venv-k8s).
"""

from __future__ import annotations

import sys

try:
    from checks.cli import main
except ModuleNotFoundError as error:  # the tools live in their own venv
    sys.exit(f"{error.name} is not installed: pip install -r deploy/k8s/requirements.txt ({error})")

if __name__ == "__main__":
    sys.exit(main())
