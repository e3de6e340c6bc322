"""Every door under a short hypothesis fuzz (bench/chaos/fuzz.py; `python -m bench.chaos.fuzz` runs it longer): each
case is accepted or refused cleanly, none crashes or hangs, and after each door the processes answer a well-formed
call, no session is left open and the gateway logged no error, while a calm conversation goes on beside the fuzz."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from harness.doors import DOORS, Door, Limits
from harness.fuzz import fuzz_door, fuzz_gateway, open_doors
from harness.health import ControlSession, LogWatch, Targets, check_batch
from tests.conftest import TRANSCRIPTS, load_clip

pytestmark = pytest.mark.integration

EXAMPLES = 24
LIMITS = Limits(hang_s=10.0)
IDLE_TIMEOUT_S = 2.0  # a WebRTC offer the gateway accepts is never connected: its session closes after this
SETTLE_S = IDLE_TIMEOUT_S + 4.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fuzzed(services: dict[str, str]) -> AsyncIterator[Targets]:
    """A gateway process of the fuzz's own over the session's services, with its browser doors, metrics and log."""
    async with fuzz_gateway(services, IDLE_TIMEOUT_S) as targets:
        yield targets


@dataclass
class Conversing:
    session: ControlSession
    stop: asyncio.Event
    task: asyncio.Future[None]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def control(fuzzed: Targets) -> AsyncIterator[Conversing]:
    """The calm conversation, running from the first door's fuzz to the last test."""
    session = ControlSession(fuzzed.gateway, load_clip("spk1_snt1"), TRANSCRIPTS["spk1_snt1"])
    stop = asyncio.Event()
    conversing = Conversing(session, stop, asyncio.ensure_future(session.run(stop)))
    yield conversing
    stop.set()
    await conversing.task


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def doors(fuzzed: Targets) -> AsyncIterator[dict[str, Door]]:
    async with open_doors(fuzzed, LIMITS) as opened:
        yield opened


@pytest.fixture(scope="module")
def logs(fuzzed: Targets) -> LogWatch:
    return LogWatch(fuzzed.logs)


@pytest.mark.parametrize("door", DOORS)
async def test_a_door_answers_fuzz_with_acceptances_and_clean_refusals_only(
    door: str, doors: dict[str, Door], fuzzed: Targets, control: Conversing, logs: LogWatch
) -> None:
    figures = await fuzz_door(doors[door], EXAMPLES, limits=LIMITS)
    report = json.dumps(figures.as_dict(), indent=1)
    assert figures.cases == EXAMPLES, report
    assert not (figures.crashes or figures.hangs or figures.unexpected_cases or figures.unexpected), report
    assert figures.accepted and figures.clean_errors, f"the fuzz reached only one side of the door: {report}"
    check = await check_batch(door, fuzzed, control.session, SETTLE_S, logs)
    assert check["ok"], json.dumps(check, indent=1)
    assert not control.session.failures, json.dumps(control.session.summary(), indent=1)


async def test_the_calm_conversation_beside_the_fuzz_was_unaffected(control: Conversing) -> None:
    control.stop.set()
    await control.task
    summary = control.session.summary()
    assert summary["conversations"] >= 1 and not summary["failures"], json.dumps(summary, indent=1)
