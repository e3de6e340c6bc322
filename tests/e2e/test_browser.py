"""The page in a real browser (Debian chromium, a real-speech WAV as its microphone) against the whole mesh:
a turn over WebRTC, the automatic move to WebSocket when WebRTC fails, barge-in, and refusals shown to the user.

`python -m tests.e2e` runs these in a loopback-only network namespace.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.server import GatewaySettings, build_server
from harness.browser import SCRIPTED_MIC, load_into_mic
from tests.conftest import free_port, load_clip
from tests.e2e.conftest import page_talking
from voicemesh import telemetry

TURN_TIMEOUT_S = 60.0

# A turn is complete for the page once the user's words are transcribed and the reply has been heard.
HEARD = "Object.values(s.turns).some((t) => t.user_text && t.reply_text && t.played_ms > 0)"
# ... and the page has put together where its voice-to-voice went (the gateway's metrics come after the audio).
HEARD_WITH_HOPS = "Object.values(s.turns).some((t) => t.user_text && t.played_ms > 0 && t.hops)"
# ... and timed, or known to be untimed: a reply heard while the microphone has not yet named the end of the speech
# (it does after 250 ms of quiet; a reply started on a partial can play sooner) is timed once it does.
HEARD_AND_TIMED = (
    "Object.values(s.turns).some((t) => t.user_text && t.reply_text && t.played_ms > 0"
    " && (t.v2v_ms > 0 || t.untimed_ms))"
)
HOPS = {
    "webrtc": {"endpoint_alignment", "gateway", "downlink", "buffer"},
    "websocket": {"endpoint_alignment", "capture_to_sent", "sent_to_gateway", "gateway", "downlink", "buffer"},
}


def check_hops(turn: dict) -> None:
    """Every hop of the turn's path is there, and together they are the page's voice-to-voice."""
    hops = turn["hops"]
    assert set(hops) == HOPS[turn["transport"]], hops
    assert sum(hops.values()) == pytest.approx(turn["v2v_ms"], abs=1.0), hops
    metrics = turn["metrics"]
    assert hops["gateway"] == pytest.approx(metrics["v2v_ms"] - metrics.get("upload_ms", 0), abs=0.01)


def heard_turns(state: dict) -> list[dict]:
    return [t for t in state["turns"].values() if t.get("user_text") and t.get("played_ms")]


async def reported(stage: str, before: float) -> bool:
    """Whether the gateway's histogram of `stage` grew past `before` (the page's report is on its way)."""
    for _ in range(50):
        if telemetry.TURN_STAGE.labels(stage)._sum.get() > before:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_over_webrtc_the_page_shows_the_transcript_and_plays_the_reply(playwright, web_gateway) -> None:
    playouts = telemetry.TURN_STAGE.labels("playout")._sum.get()
    async with page_talking(playwright, web_gateway, [1.0, load_clip("spk1_snt1"), 12.0]) as page:
        state = await page.wait_until(HEARD_WITH_HOPS, TURN_TIMEOUT_S)
        playout_reported = await reported("playout", playouts)
        shown = await page.page.inner_text("#conversation")
        latency_rows = await page.page.locator("#latency tbody tr").count()
        # What the page does after a reply Chromium had to conceal: the receiver's target grows by steps, capped.
        for _ in range(6):
            await page.page.evaluate("window.voicemesh.raiseRtcJitterTarget()")
        raised = await page.state()
        await page.page.click("#mic")  # stop: the gateway lets the reply finish, then ends the session
        ended = await page.wait_until("s.status === 'ended'", TURN_TIMEOUT_S)
    assert state["transport"] == "webrtc" and state["fallbackReason"] is None
    assert "connected" in state["iceStates"]
    assert state["rtcJitterTargetMs"] == 40, "Chromium took the receiver's starting jitter buffer target"
    assert raised["rtcJitterTargetMs"] == 200 and raised["rtcJitterRaises"] >= 4, "raised in steps up to 200 ms"
    kinds = {e["type"] for e in state["events"]}
    assert {"started", "user_partial", "user_final", "reply_text"} <= kinds
    turn = heard_turns(state)[0]
    assert "child" in turn["user_text"].lower() and "child" in shown.lower()
    assert turn["reply_text"].strip() and turn["reply_text"].strip()[:20] in shown
    assert turn["v2v_ms"] > 0, "the page measured voice-to-voice for the turn"
    check_hops(turn)
    # Heard through the <audio> element: the receiver's delivery plus the output delay Chromium reports for it.
    assert state["rtcOutputDelayMs"] is not None and state["rtcOutputDelayMs"] > 0
    assert turn["hops"]["buffer"] == pytest.approx(state["rtcOutputDelayMs"], abs=1.0)
    assert playout_reported, "the page reported when the reply was delivered and heard"
    assert latency_rows >= 1
    assert ended["closed"]["code"] == 1000 and not ended["error"]


async def test_when_webrtc_cannot_connect_the_page_moves_to_websocket_and_completes_a_turn(
    playwright, web_gateway
) -> None:
    # The candidates are dropped, as a network that blocks UDP would: ICE never connects, the timeout fires.
    microphone = [4.0, load_clip("spk1_snt1"), 12.0]
    playouts = telemetry.TURN_STAGE.labels("playout")._sum.get()
    async with page_talking(playwright, web_gateway, microphone, "?simulate=ice-blocked") as page:
        state = await page.wait_until(f"s.transport === 'websocket' && {HEARD_WITH_HOPS}", TURN_TIMEOUT_S)
        playout_reported = await reported("playout", playouts)
    assert state["fallbackReason"], "the page says why it left WebRTC"
    assert state["error"] in (None, ""), state["error"]
    turn = heard_turns(state)[0]
    assert "child" in turn["user_text"].lower() and turn["transport"] == "websocket"
    check_hops(turn)
    assert playout_reported, "the page reported its hops to the gateway"
    history = web_gateway.servicer.history(state["sessionId"])
    assert history and (history[0].role, history[0].text) == ("user", turn["user_text"])


async def test_a_conversation_that_loses_webrtc_goes_on_over_websocket_with_its_history(
    playwright, web_gateway
) -> None:
    async with page_talking(playwright, web_gateway, [1.0, load_clip("spk2_snt1"), 11.0]) as page:
        first = await page.wait_until(HEARD, TURN_TIMEOUT_S)
        assert first["transport"] == "webrtc"
        await page.wait_until("Object.values(s.turns).some((t) => t.metrics)", TURN_TIMEOUT_S)
        await page.page.evaluate("window.voicemesh.simulateNetworkLoss()")
        state = await page.wait_until(
            "s.transport === 'websocket' && Object.values(s.turns).some((t) => t.index >= 1 && t.played_ms && t.metrics)",
            2 * TURN_TIMEOUT_S,
        )
    started = [e for e in state["events"] if e["type"] == "started"]
    assert len(started) == 2 and started[1]["session_id"] == started[0]["session_id"] == state["sessionId"]
    assert started[1]["history_turns"] >= 1, "the WebSocket session continued the WebRTC one's history"
    history = web_gateway.servicer.history(state["sessionId"])
    assert [entry.role for entry in history][:4] == ["user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("transport", ["webrtc", "websocket"])
async def test_barge_in_from_the_page_stops_the_reply(playwright, web_gateway, transport) -> None:
    """The user asks (spk1_snt1) and talks over the reply (wizard.wav) 0.3 s after the page first hears it.

    One take, with fixed inputs: both are recordings, fed once each through a scripted microphone
    (`harness.browser.SCRIPTED_MIC`) instead of chromium's fake device, which loops its WAV from when the page
    opens it, so that the speech met the reply at a wall-clock guess and a run waited for whichever loop happened to
    land on a reply. The page plays the question once the session listens, and the interruption a fixed 0.3 s after
    the reply is first heard (the page's state, polled in the page every 5 ms), however late the reply starts: the
    reply is ~1.8 s long, so the interruption is heard well inside it. A failure here is the pipeline's."""
    barged = "s.interrupts.some((i) => i.stopped_ms && s.turns[i.turn] && s.turns[i.turn].played_ms)"
    heard = "Object.values(s.turns).some((t) => t.played_ms > 0)"
    async with page_talking(
        playwright, web_gateway, [1.0], f"?transport={transport}", init_script=SCRIPTED_MIC
    ) as page:
        await load_into_mic(page.page, "question", load_clip("spk1_snt1"))
        await load_into_mic(page.page, "interruption", load_clip("wizard"))
        await page.page.evaluate(f"window.voicemesh_mic.playWhen('interruption', {heard!r}, 300)")
        await page.wait_until("s.status === 'listening'", TURN_TIMEOUT_S)
        await page.page.evaluate("window.voicemesh_mic.play('question')")
        state = await page.wait_until(barged, 2 * TURN_TIMEOUT_S)
        played = await page.page.evaluate("window.voicemesh_mic.played")
    assert [p["name"] for p in played] == ["question", "interruption"], played
    assert state["transport"] == transport
    interrupt = next(
        i for i in state["interrupts"] if i["stopped_ms"] and state["turns"][str(i["turn"])].get("played_ms")
    )
    interrupted = state["turns"][str(interrupt["turn"])]
    assert interrupted["interrupted"], "the page marked the reply as interrupted"
    assert state["audioAfterInterrupt"] == 0, "no audio of an interrupted reply reached the page afterwards"
    assert any(e["type"] == "interrupted" and e["turn_index"] == interrupt["turn"] for e in state["events"])


# A tab in the background, as Chromium runs one: hidden, and its timers fire at most once a second. (Headless
# Chromium never hides a page, so the page is told so and its timers are slowed here.) Audio and network events are
# not throttled in a background tab, and the page's audio path uses only those.
BACKGROUND_TAB = """
Object.defineProperty(document, "hidden", { get: () => true });
Object.defineProperty(document, "visibilityState", { get: () => "hidden" });
const throttle = (timer) => (callback, delay, ...args) => timer(callback, Math.max(1000, delay || 0), ...args);
window.setInterval = throttle(window.setInterval.bind(window));
window.setTimeout = throttle(window.setTimeout.bind(window));
"""


@pytest.mark.parametrize("transport", ["webrtc", "websocket"])
async def test_a_page_in_a_background_tab_is_heard_whole_and_never_times_a_reply_wrongly(
    playwright, web_gateway, transport
) -> None:
    microphone = [1.0, load_clip("spk1_snt1"), 12.0]
    async with page_talking(
        playwright, web_gateway, microphone, f"?transport={transport}", init_script=BACKGROUND_TAB
    ) as page:
        state = await page.wait_until(HEARD_AND_TIMED, TURN_TIMEOUT_S)
    assert state["transport"] == transport
    (heard,) = heard_turns(state)[:1]
    assert {"child", "hurt", "small", "dog"} <= set(heard["user_text"].lower().replace(".", "").split())
    if transport == "websocket":  # timed on the audio thread: exact in the background too
        assert heard["v2v_ms"] > 0 and not heard.get("untimed_ms")
    else:  # the receiver's onset is read by a timer, now late by up to a second: heard, and not timed
        assert heard["untimed_ms"] > 50 and heard.get("v2v_ms") is None


@pytest.mark.parametrize("query", ["", "?transport=websocket"])
async def test_a_full_gateway_tells_the_user_why(playwright, query) -> None:
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    settings = GatewaySettings(port=0, asr_target=dead[0], llm_target=dead[1], tts_target=dead[2], max_sessions=0)
    server = build_server(settings)
    await server.start()
    try:
        async with page_talking(playwright, server, [1.0], query) as page:
            state = await page.wait_until("s.status === 'error'", 20)
            shown = await page.page.inner_text("#error")
    finally:
        await server.stop()
    assert "limit of 0 sessions" in state["error"] and "limit of 0 sessions" in shown
    assert state["fallbackReason"] is None, "a refusal is not a network failure: no fallback"


# The page's reply player, driven directly: 20 ms frames of a tone posted as the WebSocket door would.
PLAYER_SCRIPT = """
async () => {
  const ctx = new AudioContext({ sampleRate: 48000 });
  await ctx.audioWorklet.addModule("/static/worklets.js");
  await ctx.resume();
  const player = new AudioWorkletNode(ctx, "reply-player", {
    numberOfInputs: 0, outputChannelCount: [1], processorOptions: { targetMs: 100 },
  });
  player.connect(ctx.destination);
  const seen = [];
  player.port.onmessage = (event) => seen.push(event.data);
  const frames = (turn, count) => {
    for (let i = 0; i < count; i++) {
      const pcm = new Int16Array(960).fill(3000);
      player.port.postMessage({ type: "frame", turn, pcm }, [pcm.buffer]);
    }
  };
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const waitFor = async (match) => {
    for (let i = 0; i < 200 && !seen.some(match); i++) await sleep(25);
    return seen.some(match);
  };
  const until = (type, turn) => waitFor((m) => m.type === type && (turn === undefined || m.turn === turn));
  const result = {};
  frames(0, 4); // 80 ms: under the 100 ms target
  await sleep(400);
  result.startedBelowTarget = seen.some((m) => m.type === "started");
  frames(0, 1); // 100 ms: playback starts, plays it out, then runs dry mid-reply
  result.startedAtTarget = await until("started", 0);
  result.underrun = await until("underrun", 0);
  frames(1, 2); // 40 ms of a reply that is complete: it plays without waiting for the target
  player.port.postMessage({ type: "end", turn: 1 });
  result.shortCompleteReplyPlayed = await until("started", 1);
  const startedAt = seen.findIndex((m) => m.type === "started" && m.turn === 1);
  await waitFor((m) => m.type === "state" && !m.playing && seen.indexOf(m) > startedAt); // that reply played out
  player.port.postMessage({ type: "target", ms: 2000 });
  frames(2, 50); // one second, under the new target: held back
  await sleep(300);
  result.heldBack = !seen.some((m) => m.type === "started" && m.turn === 2);
  player.port.postMessage({ type: "flush" });
  result.flushedMs = (await until("flushed")) ? seen.find((m) => m.type === "flushed").samples / 48 : 0;
  return result;
}
"""


async def test_the_reply_player_buffers_to_its_target_reports_underruns_and_flushes(
    playwright, offline_gateway
) -> None:
    async with page_talking(playwright, offline_gateway, [1.0], press_mic=False) as page:
        result = await page.page.evaluate(PLAYER_SCRIPT)
    assert result == {
        "startedBelowTarget": False,
        "startedAtTarget": True,
        "underrun": True,
        "shortCompleteReplyPlayed": True,
        "heldBack": True,
        "flushedMs": 1000,
    }
