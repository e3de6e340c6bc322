"""What `voicemesh up` prints for a person: a line per turn, session and problem, from the JSON logs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from voicemesh.console import follow, human_line


def test_a_turn_is_one_line_with_what_was_heard_and_replied_and_its_v2v() -> None:
    record = {
        "level": "INFO",
        "msg": "turn",
        "session_id": "3f2a9c1e-aaaa",
        "turn": 2,
        "v2v_ms": 512.4,
        "user_text": "What is the capital of Spain?",
        "reply_text": "The capital of Spain is Madrid, a city of about three million people and many museums.",
    }
    line = human_line("gateway", record)
    assert line == (
        '[3f2a9c1e] turn 2: heard "What is the capital of Spain?" -> replied '
        '"The capital of Spain is Madrid, a city of about three milli…"  V2V 512 ms'
    )
    # Without transcripts in the log (a deployment), the line still says the turn and its V2V.
    assert human_line("gateway", {**record, "user_text": None, "reply_text": None}) == "[3f2a9c1e] turn 2: V2V 512 ms"


def test_problems_are_shown_with_their_stage_and_code_and_chatter_is_not() -> None:
    warning = {"level": "WARNING", "msg": "backend down", "session_id": "abc", "stage": "tts", "code": "UNAVAILABLE"}
    assert human_line("gateway", warning) == "[abc] gateway warning: backend down (stage=tts, code=UNAVAILABLE)"
    assert human_line("llm", {"level": "ERROR", "msg": "engine failed"}) == "llm error: engine failed"
    assert human_line("asr", {"level": "INFO", "msg": "stream opened", "session_id": "abc"}) is None


async def test_follow_yields_json_lines_as_they_are_appended_and_skips_other_output(tmp_path: Path) -> None:
    path = tmp_path / "gateway.log"
    stop = asyncio.Event()
    seen: list[tuple[str, dict[str, object]]] = []

    async def collect() -> None:
        async for item in follow({"gateway": path, "asr": tmp_path / "asr.log"}, stop):
            seen.append(item)
            if len(seen) == 2:
                stop.set()

    task = asyncio.ensure_future(collect())
    await asyncio.sleep(0.05)  # the file does not exist yet: nothing happens
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps({"msg": "one"}) + "\nnot json from a library\n" + '{"msg": "tw')
    await asyncio.sleep(0.3)
    with open(path, "a", encoding="utf-8") as file:
        file.write('o"}\n')  # a line written in two pieces is read whole
    await asyncio.wait_for(task, 5)
    assert seen == [("gateway", {"msg": "one"}), ("gateway", {"msg": "two"})]
