"""Run the browser tests in a loopback-only network namespace where the machine allows one: `python -m tests.e2e`.

Arguments go to pytest. Without permission for a namespace (no root, no CAP_SYS_ADMIN) they run on the host's
loopback instead, which they only ever use anyway.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.browser import isolate_network


def main() -> int:
    if isolate_network():
        print("browser tests: loopback-only network namespace", file=sys.stderr)
    else:
        print("browser tests: no network namespace allowed here; running on the host's loopback", file=sys.stderr)
    import pytest

    return pytest.main([str(Path(__file__).resolve().parent), *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
