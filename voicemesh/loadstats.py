"""Latency summaries (count, p50/p95/p99, max, mean) shared by the load-test report, `voicemesh report` and the
benchmarks."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILE_METHOD = "linear interpolation between closest ranks (numpy default, Hyndman-Fan type 7)"
"""How the percentiles are computed; reports say it next to the numbers."""


@dataclass(frozen=True)
class Summary:
    """Percentiles of a set of durations, in their unit rounded to 0.1; None for each when there are none."""

    count: int
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None
    mean: float | None = None

    def percentiles(self) -> dict[str, float | None]:
        """p50, p95 and p99 by name."""
        return {"p50": self.p50, "p95": self.p95, "p99": self.p99}

    def to_json(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)


def summarize(values: Sequence[float]) -> Summary:
    """count, p50, p95, p99, max and mean of `values` (percentiles by `PERCENTILE_METHOD`)."""
    if not values:
        return Summary(count=0)
    p50, p95, p99 = (round(float(value), 1) for value in np.percentile(values, (50, 95, 99)))
    return Summary(
        count=len(values),
        p50=p50,
        p95=p95,
        p99=p99,
        max=round(max(values), 1),
        mean=round(sum(values) / len(values), 1),
    )
