"""Load test: N concurrent conversations of real speech against a gateway, V2V percentiles per stage, and a capacity
sweep. `options` (what a run does), `clips`, `driver` (runs it), `report`, `capacity` (sweep), `html_report`, `cli`."""

from voicemesh.loadtest.capacity import DEFAULT_BUDGET_MS, run_sweep, sweep
from voicemesh.loadtest.cli import command
from voicemesh.loadtest.clips import SpeechClip, load_clips
from voicemesh.loadtest.driver import loadtest, run_loadtest
from voicemesh.loadtest.options import LoadTestError, LoadTestOptions, check_options, is_loopback
from voicemesh.loadtest.report import LoadTestReport, SweepResult, format_summary, format_sweep

__all__ = [
    "DEFAULT_BUDGET_MS",
    "LoadTestError",
    "LoadTestOptions",
    "LoadTestReport",
    "SpeechClip",
    "SweepResult",
    "check_options",
    "command",
    "format_summary",
    "format_sweep",
    "is_loopback",
    "load_clips",
    "loadtest",
    "run_loadtest",
    "run_sweep",
    "sweep",
]
