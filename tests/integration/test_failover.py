"""A conversation survives the death of any one replica: two real replicas per stage, one of them SIGKILLed or
SIGSTOPped mid-turn, and the turn still completes, whole, with no frame lost.

- ASR: the gateway replays the utterance in progress to the other replica; the user's words all reach the turn.
- LLM: the other replica continues the reply from the words already streamed; none is repeated or lost.
- TTS: the other replica synthesizes the unspoken rest; the reply's audio frames are numbered without a gap and
  what was spoken is exactly what the LLM said.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from gateway.backends import LLM_FIRST_TOKEN_TIMEOUT_S
from gateway.server import GatewayServer
from gateway.session import Session
from harness.faults import generating, mid_utterance, replica_of, speaking, start_gateway
from tests.conftest import TRANSCRIPTS, load_clip, max_wer
from voicemesh import telemetry
from voicemesh.conversation import ReplyAudio, ReplyDone, ReplyText, SessionError, TalkTurn, talk
from voicemesh.evaluation import word_error_rate, words_of
from voicemesh.mesh import Mesh
from voicemesh.v1 import asr_pb2, conversation_pb2

pytestmark = pytest.mark.integration

TALKATIVE = conversation_pb2.SessionConfig(
    system_prompt="A talkative assistant who always answers with three long sentences.",
    options=conversation_pb2.PipelineOptions(max_tokens=120),
)
# Long enough to be more than a few frames (the checks want over half a second of reply), short enough to be quick;
# one LLM call a turn, asked once the turn has committed: a reply started speculatively (at a pause inside the
# utterance, or on a partial) and then superseded left the fault on a call nobody waited for, and the frozen replica,
# failing its health checks by then, was passed over for the real reply without a failover (failovers == 0).
TALKATIVE_SHORT_AFTER_COMMIT = conversation_pb2.SessionConfig(
    system_prompt=TALKATIVE.system_prompt,
    options=conversation_pb2.PipelineOptions(
        max_tokens=40, speculative_start=False, start_on_partials=False, prefill_partials=False
    ),
)
# Without a speculative start: a short speculative reply may be synthesized whole before its turn commits, and then
# its audio is released all at once, with no moment "speaking and still synthesizing" left to strike at.
TALKATIVE_AFTER_COMMIT = conversation_pb2.SessionConfig(
    system_prompt=TALKATIVE.system_prompt,
    options=conversation_pb2.PipelineOptions(max_tokens=120, speculative_start=False),
)
# The recording is one turn with a natural pause after its first clause; the failover is what is tested here, not
# where the end of turn falls, so only a long silence ends it.
ONE_TURN_WHATEVER_ITS_PAUSES = conversation_pb2.SessionConfig(
    options=conversation_pb2.PipelineOptions(
        endpointing=asr_pb2.EndpointingConfig(fixed_hangover=True, hangover_ms=1500, max_hangover_ms=1500)
    )
)


@dataclass
class Outcome:
    turns: list[TalkTurn]
    events: list[object]
    session: Session
    victim: str
    failovers: float
    said_before_fault: str = ""

    def turn_events(self, kind: type) -> list[Any]:
        turn = self.turns[0].turn_index
        return [e for e in self.events if isinstance(e, kind) and getattr(e, "turn_index", None) == turn]


def failovers(stage: str) -> float:
    return telemetry.FAILOVERS.labels(stage)._value.get()


async def converse_through_a_fault(
    mesh: Mesh,
    stage: str,
    fault: Callable[[str], None],
    moment: Callable[[Session], bool],
    clip_name: str,
    config: conversation_pb2.SessionConfig | None = None,
) -> Outcome:
    """Talk to a gateway over both replicas of every stage; at `moment`, apply `fault` to the replica of `stage`
    the session is using. The victim is started again afterwards."""
    server = await start_gateway(mesh)
    before = failovers(stage)
    talking = asyncio.ensure_future(talk(f"127.0.0.1:{server.port}", load_clip(clip_name), config, 8.0))
    victim = ""
    try:
        session, victim, said = await strike(server, stage, fault, moment, mesh)
        turns, _, events = await talking
        return Outcome(turns, events, session, victim, failovers(stage) - before, said)
    finally:
        talking.cancel()
        await server.stop()
        if victim:
            mesh.restart(victim)
            await mesh.wait(names=[victim])


async def strike(
    server: GatewayServer, stage: str, fault: Callable[[str], None], moment: Callable[[Session], bool], mesh: Mesh
) -> tuple[Session, str, str]:
    registry = server.registry
    assert registry is not None
    session = await until(lambda: next(iter(registry.active.values()), None))
    await until(lambda: moment(session) or None, timeout_s=30.0)
    target = replica_of(server, session, stage)
    said = "".join(next((r.text for r in session._replies.values() if r.text), []))
    victim = next(name for name, process in mesh.processes.items() if process.target == target)
    fault(victim)
    return session, victim, said


T = TypeVar("T")


async def until(probe: Callable[[], T | None], timeout_s: float = 15.0) -> T:
    """Poll `probe` every 2 ms until it gives something."""
    async with asyncio.timeout(timeout_s):
        while (found := probe()) is None:
            await asyncio.sleep(0.002)
        return found


def check_the_turn_completed_whole(outcome: Outcome, clip_name: str) -> None:
    assert len(outcome.turns) == 1, [t.user_text for t in outcome.turns]
    turn = outcome.turns[0]
    assert word_error_rate(TRANSCRIPTS[clip_name], turn.user_text) <= max_wer(clip_name), turn.user_text
    (done,) = outcome.turn_events(ReplyDone)
    reply_text = "".join(e.text_delta for e in outcome.turn_events(ReplyText))
    assert words_of(done.text) == words_of(reply_text), "what was spoken is what the LLM said, nothing lost or twice"
    seqs = [e.seq for e in outcome.turn_events(ReplyAudio)]
    assert seqs == list(range(len(seqs))) and len(seqs) > 25, "reply frames numbered without a gap or a repeat"
    errors = [e for e in outcome.events if isinstance(e, SessionError)]
    assert all(e.recoverable for e in errors), errors


def sigkill(mesh: Mesh) -> Callable[[str], None]:
    return mesh.kill


def sigstop(mesh: Mesh) -> Callable[[str], None]:
    return mesh.freeze


FAULTS: dict[str, Callable[[Mesh], Callable[[str], None]]] = {"sigkill": sigkill, "sigstop": sigstop}


@pytest.mark.parametrize("fault", FAULTS)
async def test_an_asr_replica_lost_mid_utterance_loses_no_word(replicas: Mesh, fault: str) -> None:
    outcome = await converse_through_a_fault(
        replicas, "asr", FAULTS[fault](replicas), mid_utterance, "wizard", ONE_TURN_WHATEVER_ITS_PAUSES
    )
    check_the_turn_completed_whole(outcome, "wizard")
    assert outcome.failovers >= 1, "the utterance was replayed to the other replica"
    session = outcome.session
    assert session.asr.seq and session.asr.acked == session.asr.seq, "every frame sent was acknowledged"


@pytest.mark.parametrize("fault", FAULTS)
async def test_an_llm_replica_lost_mid_reply_is_continued_without_repeating(replicas: Mesh, fault: str) -> None:
    outcome = await converse_through_a_fault(
        replicas, "llm", FAULTS[fault](replicas), generating, "spk2_snt1", TALKATIVE
    )
    check_the_turn_completed_whole(outcome, "spk2_snt1")
    assert outcome.failovers >= 1
    reply_text = outcome.turns[0].reply_text
    said = outcome.said_before_fault
    assert said and reply_text.startswith(said), (said, reply_text)
    rest = words_of(reply_text[len(said) :])
    assert rest and words_of(said) != rest[: len(words_of(said))], "the continuation does not start over"


def asked(session: Session) -> bool:
    """A reply has been asked of the LLM and no word of it has come yet."""
    return any(not reply.text and not reply.cancelled for reply in session._replies.values())


async def test_an_llm_replica_hung_before_its_first_token_is_left_at_once(
    replicas: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGSTOPped between the request for a reply and its first token: a live replica sends keepalives while a call
    waits, this one sends nothing, and the reply goes to the other replica after a second. The replica stays stopped
    until the talk ends: the failover is for its silence, not for the first-token limit (10 s)."""
    with caplog.at_level(logging.INFO, logger="gateway.backends"):
        outcome = await converse_through_a_fault(
            replicas, "llm", sigstop(replicas), asked, "spk1_snt1", TALKATIVE_SHORT_AFTER_COMMIT
        )
    assert outcome.failovers >= 1, (
        f"the fault missed: {outcome.victim} was stopped once the reply was asked, yet no LLM call failed over "
        f"(replies: {[t.reply_text for t in outcome.turns]})"
    )
    check_the_turn_completed_whole(outcome, "spk1_snt1")
    why = [getattr(r, "detail", "") for r in caplog.records if r.getMessage() == "llm replica failed; trying the next"]
    quiet_s = [float(m[1]) for m in (re.search(r"sent nothing for ([\d.]+) s", d) for d in why) if m]
    assert why and len(quiet_s) == len(why) and max(quiet_s) < LLM_FIRST_TOKEN_TIMEOUT_S / 2, why


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_tts_replica_lost_mid_reply_speaks_the_rest_elsewhere(replicas: Mesh, fault: str) -> None:
    outcome = await converse_through_a_fault(
        replicas, "tts", FAULTS[fault](replicas), speaking, "spk2_snt1", TALKATIVE_AFTER_COMMIT
    )
    check_the_turn_completed_whole(outcome, "spk2_snt1")
    assert outcome.failovers >= 1
