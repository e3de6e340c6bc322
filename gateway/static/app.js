// The voicemesh page: talk to the gateway from a browser. WebRTC first (Opus both ways, events on a data
// channel); if ICE fails or is not connected within the gateway's timeout, the same session moves to the
// WebSocket door (PCM16 frames, a jitter buffer here) and the conversation goes on.
// Query options: transport=auto|webrtc|websocket, simulate=ice-blocked (drop ICE candidates, as a network that
// blocks UDP would), max_tokens=N, system_prompt=..., aec=0 (no echo cancellation), autostart=1,
// jitter_ms=N (the WebSocket jitter buffer's starting and lowest target; default 60),
// rtc_jitter_ms=N (the WebRTC receiver's starting jitterBufferTarget, raised after a reply that came too late;
// default 40; 0 = as low as the network allows; -1 = Chromium's own, never raised).
// A gateway that wants a credential gets it from the fragment: open the page as /#token=... . A fragment never
// reaches a server, so the token stays out of access logs; it goes in a header, or in the WebSocket's first message.

const params = new URLSearchParams(location.search);
const token = new URLSearchParams(location.hash.slice(1)).get("token") || "";
function authHeader() {
  return token ? { Authorization: `Bearer ${token}` } : {};
}
// The WebRTC receiver's jitter buffer target: where it starts, and how it grows after a reply whose packets came
// too late for it (Chromium concealed audio), as the WebSocket buffer grows after an underrun: small while replies
// come in time, larger once one came late (docs/decisions/0030). Chromium still raises its buffer on a network that
// jitters more.
const RTC_JITTER_TARGET_MS = 40;
const RTC_JITTER_STEP_MS = 40;
const RTC_JITTER_MAX_MS = 200;
const option = {
  transport: params.get("transport") || "auto",
  iceBlocked: params.get("simulate") === "ice-blocked",
  maxTokens: Number(params.get("max_tokens") || 0),
  systemPrompt: params.get("system_prompt") || "",
  echoCancellation: params.get("aec") !== "0",
  autostart: params.get("autostart") === "1",
  rtcJitterMs: Number(params.get("rtc_jitter_ms") ?? RTC_JITTER_TARGET_MS),
};
// Loopback and LAN links jitter by a few ms; the gateway sends a reply's first 100 ms at once, then in real time.
// So playback starts after 60 ms of audio, and an underrun the network caused grows the target by a step.
const JITTER_START_MS = Math.max(20, Number(params.get("jitter_ms") || 60));
const JITTER_MAX_MS = 800;
const UNDERRUN_STEP_MS = 40;
const EVENTS_KEPT = 500; // state.events keeps the latest; a partial transcript comes every ~200 ms of speech
const RTC_LOUD = 0.001; // a WebRTC packet's audio level (0-1, linear) above this is sound: -60 dBov, silence is 0
const RTC_SILENT_AFTER_MS = 100; // a WebRTC reply stopped playing once no loud packet came for this long
const RTC_POLL_MS = 5; // how often the page asks the WebRTC receiver which packet it delivered last
const RTC_POLL_LATE_MS = 50; // a poll this late (a background tab runs timers once a second) cannot time an onset
const HEADER_BYTES = 12; // <q time_us><I seq or turn_index>, little-endian

const $ = (id) => document.getElementById(id);

// Everything the page knows, also read by the browser tests and the browser benchmark.
const state = {
  status: "idle",
  transport: null,
  sessionId: null,
  resumeToken: "", // from the gateway: resumes this session (a reconnect, the WebRTC -> WebSocket move)
  fallbackReason: null,
  iceStates: [],
  events: [], // the gateway's latest events (EVENTS_KEPT), oldest first
  // index -> {user_text, reply_text, played_ms, speech_end_ms, v2v_ms, metrics, interrupted, received_ms, hops}
  turns: {},
  speechEnds: [], // epoch ms of the ends of the user's speech, as the microphone heard them
  micVoiced: false, // the microphone hears speech, or its tail, and has not named its end yet
  playing: false,
  interruptions: 0,
  flushedMs: 0,
  audioAfterInterrupt: 0,
  interrupts: [], // {turn, at_ms, stopped_ms}: each barge-in, and when the reply stopped playing after it
  // underruns: the audio ran out because it came late (the network); starved: because the gateway had none yet.
  jitter: { jitterMs: 0, targetMs: JITTER_START_MS, underruns: 0, starved: 0, underrunTurns: [] },
  rtcJitterTargetMs: null, // the WebRTC receiver's jitterBufferTarget as Chromium took it (null: not set)
  rtcJitterRaises: 0, // how often a reply that came too late raised it
  rtcJitterBufferMs: null, // the WebRTC receiver's mean jitter buffer delay (getStats), ms
  rtcOutputDelayMs: null, // the WebRTC track's output delay (getStats media-playout), ms: delivered -> heard
  rtcConcealedAtTurn: null, // {index, concealed}: the receiver's concealed non-silent samples when a turn played
  error: null,
  closed: null,
};
window.voicemesh = { state, start, stop, simulateNetworkLoss, raiseRtcJitterTarget };

let config = null; // /api/config
let ctx = null;
let micStream = null;
let capture = null; // mic-capture node
let player = null; // reply-player node (WebSocket), made when that transport starts
let replyMeter = null; // level-meter on the player: when a WebSocket reply is heard
let rtc = null; // {pc, channel}
let ws = null;
let uplinkSeq = 0;
const sentAt = new Map(); // capture time (us, as the frame's header says) -> when the page sent it (epoch ms)
const SENT_KEPT = 1000; // 20 s of frames: the gateway names the last speech frame of a turn by its capture time
let lastTransit = null;
let pendingUnderrun = null; // turn whose audio ran dry; its next frame tells who was late: network or gateway
let stopping = false;

// ---- clock: AudioContext time -> epoch milliseconds -------------------------------------------------------------
function epochMsAt(contextTime) {
  return performance.timeOrigin + performance.now() - (ctx.currentTime - contextTime) * 1000;
}
function playedEpochMs(contextTime) {
  return epochMsAt(contextTime) + (ctx.outputLatency || ctx.baseLatency || 0) * 1000;
}

// ---- UI ----------------------------------------------------------------------------------------------------------
function setStatus(text) {
  state.status = text;
  $("status").textContent = text;
  $("mic").textContent = text === "idle" || text === "ended" || text === "error" ? "Start talking" : "Stop";
  $("mic").setAttribute("aria-pressed", String(!["idle", "ended", "error"].includes(text)));
}
function setTransport(name, detail) {
  state.transport = name;
  $("transport").textContent = detail ? `${name} (${detail})` : name;
  $("jitter").textContent = name === "webrtc" ? "WebRTC's own" : `${Math.round(state.jitter.targetMs)} ms`;
}
function showError(message) {
  state.error = message;
  $("error").textContent = message;
  $("error").hidden = !message;
}
function turn(index) {
  if (!state.turns[index]) {
    state.turns[index] = { index, user_text: "", reply_text: "", transport: state.transport, interrupted: false };
    const item = document.createElement("li");
    item.id = `turn-${index}`;
    item.innerHTML = '<p class="you"></p><p class="assistant"></p>';
    $("conversation").append(item);
  }
  return state.turns[index];
}
function renderTurn(t) {
  const item = $(`turn-${t.index}`);
  item.querySelector(".you").textContent = t.user_text;
  item.querySelector(".assistant").textContent = t.reply_text + (t.interrupted ? " —" : "");
  $("reply").textContent = t.reply_text;
}
const ms = (value) => (value === undefined || value === null ? "" : Math.round(value));
function renderLatency(t) {
  let row = $(`latency-${t.index}`);
  if (!row) {
    row = document.createElement("tr");
    row.id = `latency-${t.index}`;
    $("latency").querySelector("tbody").append(row);
  }
  const m = t.metrics || {};
  const cells = [
    t.index,
    t.transport,
    ms(t.v2v_ms),
    ms(m.v2v_ms),
    t.transport === "webrtc" ? "–" : ms(m.upload_ms),
    ms(m.endpoint_ms),
    `${ms(m.asr_queue_ms)}+${ms(m.asr_compute_ms)}`,
    `${ms(m.llm_queue_ms)}+${ms(m.llm_first_token_ms)}`,
    `${ms(m.tts_queue_ms)}+${ms(m.tts_first_audio_ms)}`,
    ms(m.gateway_hold_ms),
    t.played_ms && m.first_audio_sent_us ? ms(t.played_ms - m.first_audio_sent_us / 1000) : "",
  ];
  row.replaceChildren(...cells.map((value) => Object.assign(document.createElement("td"), { textContent: value })));
}

// ---- events (the same for both transports) ----------------------------------------------------------------------
function onEvent(message) {
  state.events.push(message);
  if (state.events.length > EVENTS_KEPT) state.events.splice(0, state.events.length - EVENTS_KEPT);
  const t = message.turn_index;
  switch (message.type) {
    case "started":
      state.sessionId = message.session_id;
      state.resumeToken = message.resume_token || state.resumeToken;
      setStatus("listening");
      break;
    case "user_partial":
      $("partial").textContent = message.text;
      break;
    case "user_final":
      $("partial").textContent = "";
      turn(t).user_text = message.text;
      renderTurn(turn(t));
      break;
    case "reply_text":
      turn(t).reply_text += message.text_delta;
      renderTurn(turn(t));
      break;
    case "reply_done":
      if (player) player.port.postMessage({ type: "end", turn: t });
      if (state.transport === "websocket" && !state.jitter.underrunTurns.includes(t)) {
        // A reply that the network did not starve: ease the target back toward what the jitter asks for.
        setJitterTarget(Math.max(jitterFloorMs(), state.jitter.targetMs - UNDERRUN_STEP_MS / 2));
      }
      break;
    case "interrupted":
      state.interruptions += 1;
      state.interrupts.push({ turn: t, at_ms: Date.now(), stopped_ms: state.playing ? null : Date.now() });
      turn(t).interrupted = true;
      renderTurn(turn(t));
      // None of the reply was heard: the user went on with the same turn, whose next user_final has these words.
      if (message.continued) $(`turn-${t}`).hidden = true;
      if (player) player.port.postMessage({ type: "flush" });
      break;
    case "metrics":
      turn(t).metrics = message;
      measureHops(turn(t));
      renderLatency(turn(t));
      break;
    case "error":
      showError(`${message.code}: ${message.message}`);
      break;
    case "closed": // the gateway ended the WebRTC session
      onClosed(message.code, message.reason);
      break;
  }
}

function onPlayed(index, playedMs) {
  const t = turn(index);
  if (t.played_ms) return;
  t.played_ms = playedMs;
  if (t.untimed_ms) {
    renderLatency(t); // heard; its voice-to-voice is not known to better than t.untimed_ms, so it is not reported
    return;
  }
  if (state.transport === "webrtc") {
    // WebRTC hides when a packet arrived: the gateway's downlink stage ends when the receiver delivered the first
    // audible packet, after Chromium's jitter buffer; its playout hop is the output device's delay.
    sendControl({
      type: "report",
      turn_index: index,
      first_audio_received_us: Math.round(t.rtc_delivered_ms * 1000),
      first_audio_played_us: Math.round(playedMs * 1000),
    });
  }
  if (state.micVoiced) {
    // The microphone still hears the user's speech or its tail (it names the end once 250 ms of quiet followed):
    // a fast reply can start before that. The turn is timed from that end once it is known.
    t.awaiting_speech_end = true;
    renderLatency(t);
    return;
  }
  timeTurn(t);
}

// The turn's voice-to-voice, from the last end of speech the microphone heard before its reply played.
function timeTurn(t) {
  const before = state.speechEnds.filter((end) => end < t.played_ms);
  if (before.length) {
    t.speech_end_ms = before[before.length - 1];
    t.v2v_ms = t.played_ms - t.speech_end_ms;
  }
  measureHops(t);
  renderLatency(t);
}

// Where a turn's voice-to-voice went, hop by hop (ms). The hops telescope: they add up to t.v2v_ms exactly.
// - endpoint_alignment: the gateway's end of speech (the capture time of the last frame its ASR heard as speech)
//   less the page's (its microphone level meter's); on WebRTC the gateway knows only when that frame arrived, so
//   this hop is the whole uplink there (capture, Opus, network, aiortc's jitter buffer, resampling).
// - capture_to_sent: that frame's capture -> the page sent it (WebSocket).
// - sent_to_gateway: sent -> the gateway received it (WebSocket; the gateway's upload_ms less capture_to_sent).
// - gateway: received -> the first reply frame sent (ASR, LLM, TTS and the gateway's own hold).
// - downlink: sent -> the page received the first reply frame (WebSocket); on WebRTC, -> the receiver delivered
//   its first audible packet to the track (see watchRtcSource).
// - buffer: received -> played: the jitter buffer and the audio output (WebSocket); on WebRTC, delivered ->
//   played: the output device's delay, as Chromium reports it for the track's playout (getStats media-playout).
function measureHops(t) {
  const m = t.metrics;
  if (!m || !t.played_ms || t.speech_end_ms === undefined || !m.speech_end_capture_us) return;
  const speechEndMs = Number(m.speech_end_capture_us) / 1000;
  const firstSentMs = Number(m.first_audio_sent_us) / 1000;
  const uploadMs = m.upload_ms || 0;
  const hops = { endpoint_alignment: speechEndMs - t.speech_end_ms };
  if (t.transport === "websocket") {
    const sentMs = sentAt.get(Number(m.speech_end_capture_us));
    if (sentMs === undefined || !t.received_ms) return;
    hops.capture_to_sent = sentMs - speechEndMs;
    hops.sent_to_gateway = speechEndMs + uploadMs - sentMs;
    hops.gateway = m.v2v_ms - uploadMs;
    hops.downlink = t.received_ms - firstSentMs;
    hops.buffer = t.played_ms - t.received_ms;
    if (!t.hops) {
      // The gateway puts the page's own hops in the turn's trace and its stage histogram.
      sendControl({
        type: "report",
        turn_index: t.index,
        first_audio_played_us: Math.round(t.played_ms * 1000),
        speech_end_frame_sent_us: Math.round(sentMs * 1000),
      });
    }
  } else {
    if (!t.rtc_delivered_ms) return; // played after the move to WebSocket: its path was neither door's whole
    hops.gateway = m.v2v_ms - uploadMs;
    hops.downlink = t.rtc_delivered_ms - firstSentMs; // Opus, the network, Chromium's jitter buffer, the decoder
    hops.buffer = t.played_ms - t.rtc_delivered_ms; // the output device
  }
  t.hops = hops;
}

// A reply came too late for the WebRTC receiver's buffer: a step longer, up to RTC_JITTER_MAX_MS (not where the
// page was told to leave Chromium's default, rtc_jitter_ms=-1).
function raiseRtcJitterTarget() {
  const receiver = rtc && rtc.receiver;
  if (!receiver || option.rtcJitterMs < 0 || !("jitterBufferTarget" in receiver)) return;
  const current = receiver.jitterBufferTarget || 0;
  if (current >= RTC_JITTER_MAX_MS) return;
  receiver.jitterBufferTarget = Math.min(RTC_JITTER_MAX_MS, current + RTC_JITTER_STEP_MS);
  state.rtcJitterTargetMs = receiver.jitterBufferTarget;
  state.rtcJitterRaises += 1;
}

// WebRTC's receiver, from getStats: the mean jitter buffer delay so far, audio it had to invent because packets
// came late (concealed samples that were not silence), counted per turn from the first played sample, and the
// output device's delay (media-playout: from the moment the track's audio is pulled to the moment it is heard).
// Returns that delay in ms (the AudioContext's output latency where the browser does not report it).
async function sampleRtcStats(t) {
  let outputDelayMs = (ctx.outputLatency || ctx.baseLatency || 0) * 1000;
  if (!rtc) return outputDelayMs;
  const stats = await rtc.pc.getStats();
  stats.forEach((report) => {
    if (report.type === "media-playout" && report.totalSamplesCount > 0) {
      outputDelayMs = (report.totalPlayoutDelay / report.totalSamplesCount) * 1000;
      state.rtcOutputDelayMs = outputDelayMs;
    }
    if (report.type !== "inbound-rtp" || report.kind !== "audio") return;
    const concealed = (report.concealedSamples || 0) - (report.silentConcealedSamples || 0);
    if (state.rtcConcealedAtTurn !== null) {
      const previous = turn(state.rtcConcealedAtTurn.index);
      previous.rtc_concealed_ms = ((concealed - state.rtcConcealedAtTurn.concealed) / ctx.sampleRate) * 1000;
      if (previous.rtc_concealed_ms > 0) raiseRtcJitterTarget();
    }
    state.rtcConcealedAtTurn = { index: t.index, concealed };
    if (report.jitterBufferEmittedCount) {
      state.rtcJitterBufferMs = (report.jitterBufferDelay / report.jitterBufferEmittedCount) * 1000;
    }
  });
  return outputDelayMs;
}

function sendControl(message) {
  const text = JSON.stringify(message);
  if (state.transport === "webrtc" && rtc && rtc.channel.readyState === "open") rtc.channel.send(text);
  else if (state.transport === "websocket" && ws && ws.readyState === WebSocket.OPEN) ws.send(text);
  else return false;
  return true;
}

function onClosed(code, reason) {
  if (state.closed) return;
  state.closed = { code, reason };
  if (code !== 1000 && code !== 4409) showError(reason || `closed (${code})`);
  teardown();
  setStatus(code === 1000 ? "ended" : "error");
}

// ---- audio graph ----------------------------------------------------------------------------------------------
async function openAudio() {
  ctx = new AudioContext({ sampleRate: 48000, latencyHint: "interactive" });
  await ctx.audioWorklet.addModule("/static/worklets.js");
  await ctx.resume();
  micStream = await navigator.mediaDevices.getUserMedia({
    audio: {
      channelCount: 1,
      echoCancellation: option.echoCancellation,
      noiseSuppression: true,
      autoGainControl: true,
    },
  });
  capture = new AudioWorkletNode(ctx, "mic-capture", { numberOfOutputs: 0 });
  ctx.createMediaStreamSource(micStream).connect(capture);
  capture.port.onmessage = (event) => onCapture(event.data);
}

// The WebSocket's reply player and the meter on it; WebRTC plays its track through the page's <audio> element.
function openPlayer() {
  if (player) return;
  player = new AudioWorkletNode(ctx, "reply-player", {
    numberOfInputs: 0,
    outputChannelCount: [1],
    processorOptions: { targetMs: JITTER_START_MS },
  });
  player.connect(ctx.destination);
  player.port.onmessage = (event) => onPlayer(event.data);
  // "Played" means audible: the reply's first loud render block (128 samples) plus the output latency.
  replyMeter = new AudioWorkletNode(ctx, "level-meter", { numberOfOutputs: 0 });
  player.connect(replyMeter);
  replyMeter.port.onmessage = (event) => onReplyLevel(event.data);
}

function onReplyLevel(message) {
  if (state.transport !== "websocket") return;
  setPlaying(message.type === "active");
  if (message.type !== "active") return;
  const pending = Object.values(state.turns).filter((t) => t.user_text && !t.played_ms && !t.interrupted);
  if (pending.length) onPlayed(pending[pending.length - 1].index, playedEpochMs(message.t));
}

function onCapture(message) {
  if (message.type === "speech_start") {
    state.micVoiced = true;
  } else if (message.type === "speech_end") {
    const end = epochMsAt(message.t);
    state.speechEnds.push(end);
    state.micVoiced = false;
    for (const t of Object.values(state.turns).filter((t) => t.awaiting_speech_end)) {
      t.awaiting_speech_end = false;
      if (end < t.played_ms) timeTurn(t); // else the reply began while the user was still talking: not timed
    }
  } else if (message.type === "frame" && ws && ws.readyState === WebSocket.OPEN && state.transport === "websocket") {
    const data = new ArrayBuffer(HEADER_BYTES + message.pcm.byteLength);
    const view = new DataView(data);
    view.setBigInt64(0, BigInt(Math.round(epochMsAt(message.t) * 1000)), true);
    view.setUint32(8, uplinkSeq++, true);
    new Int16Array(data, HEADER_BYTES).set(message.pcm);
    ws.send(data);
    sentAt.set(Number(view.getBigInt64(0, true)), performance.timeOrigin + performance.now());
    if (sentAt.size > SENT_KEPT) sentAt.delete(sentAt.keys().next().value);
  }
}

function onPlayer(message) {
  if (message.type === "started") {
    turn(message.turn).first_sample_ms = playedEpochMs(message.t);
  } else if (message.type === "underrun") {
    pendingUnderrun = message.turn;
  } else if (message.type === "flushed") {
    state.flushedMs += (message.samples / ctx.sampleRate) * 1000;
  }
}

function setPlaying(playing) {
  state.playing = playing;
  if (playing) return;
  for (const interrupt of state.interrupts) if (interrupt.stopped_ms === null) interrupt.stopped_ms = Date.now();
}

function setJitterTarget(targetMs) {
  const clamped = Math.min(JITTER_MAX_MS, Math.max(JITTER_START_MS, targetMs));
  if (Math.abs(clamped - state.jitter.targetMs) < 1) return;
  state.jitter.targetMs = clamped;
  player.port.postMessage({ type: "target", ms: clamped });
  $("jitter").textContent = `${Math.round(clamped)} ms`;
}

// The buffer target: never below what the measured jitter asks for; up by a step at each underrun that the
// network caused; down by half a step after each reply that played through without running dry. When the gateway
// itself had no audio yet (synthesis behind real time), a bigger buffer would only delay every later reply.
function jitterFloorMs() {
  return JITTER_START_MS + 4 * state.jitter.jitterMs;
}

// Interarrival jitter as in RFC 3550 (smoothed |change in transit time|).
function measureJitter(sentUs) {
  const transit = performance.timeOrigin + performance.now() - sentUs / 1000;
  if (lastTransit !== null) {
    const lateMs = transit - lastTransit; // this frame's extra delay over the previous one's
    state.jitter.jitterMs += (Math.abs(lateMs) - state.jitter.jitterMs) / 16;
    if (pendingUnderrun !== null) {
      if (lateMs > 20) {
        state.jitter.underruns += 1;
        state.jitter.underrunTurns.push(pendingUnderrun);
        setJitterTarget(state.jitter.targetMs + UNDERRUN_STEP_MS);
      } else {
        state.jitter.starved += 1;
      }
    }
    if (jitterFloorMs() > state.jitter.targetMs) setJitterTarget(jitterFloorMs());
  }
  pendingUnderrun = null;
  lastTransit = transit;
}

// ---- WebRTC ------------------------------------------------------------------------------------------------------
class Refused extends Error {}

function stripCandidates(sdp) {
  return sdp
    .split("\r\n")
    .filter((line) => !line.startsWith("a=candidate") && !line.startsWith("a=end-of-candidates"))
    .join("\r\n");
}

function reportIce(iceState) {
  state.iceStates.push(iceState);
  fetch("/api/ice-state", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ session_id: state.sessionId, state: iceState }),
  }).catch(() => {});
}

function gathered(pc, timeoutMs) {
  return new Promise((resolve) => {
    if (pc.iceGatheringState === "complete") return resolve();
    const timer = setTimeout(resolve, timeoutMs);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") {
        clearTimeout(timer);
        resolve();
      }
    });
  });
}

// Resolves when the connection is up, rejects on failure or after `timeoutMs`.
function connected(pc, channel, timeoutMs) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`not connected after ${timeoutMs / 1000} s`)), timeoutMs);
    const check = () => {
      if (pc.connectionState === "connected" && channel.readyState === "open") {
        clearTimeout(timer);
        resolve();
      } else if (pc.connectionState === "failed" || pc.iceConnectionState === "failed") {
        clearTimeout(timer);
        reject(new Error("ICE failed"));
      }
    };
    pc.addEventListener("connectionstatechange", check);
    pc.addEventListener("iceconnectionstatechange", check);
    channel.addEventListener("open", check);
    check();
  });
}

async function startWebRtc() {
  setTransport("webrtc", "connecting");
  const pc = new RTCPeerConnection({ iceServers: config.ice_servers });
  const channel = pc.createDataChannel("events", { ordered: true });
  rtc = { pc, channel };
  pc.addTransceiver(micStream.getAudioTracks()[0], { direction: "sendrecv", streams: [micStream] });
  channel.onmessage = (event) => onEvent(JSON.parse(event.data));
  pc.ontrack = (event) => {
    // Chromium's jitter buffer otherwise holds a margin for networks far worse than loopback or a LAN.
    if (option.rtcJitterMs >= 0 && "jitterBufferTarget" in event.receiver) {
      event.receiver.jitterBufferTarget = option.rtcJitterMs;
      state.rtcJitterTargetMs = event.receiver.jitterBufferTarget;
    }
    playRemote(event.streams[0] || new MediaStream([event.track]));
    rtc.receiver = event.receiver;
    rtc.sourceWatch = setInterval(watchRtcSource, RTC_POLL_MS);
  };
  // Once up, a connection that fails (the network changed, a firewall woke up) moves to WebSocket too.
  const failedAfterConnecting = () => {
    const failed = pc.iceConnectionState === "failed" || pc.connectionState === "failed";
    if (failed && rtc && rtc.pc === pc && rtc.connected) fallBack("the WebRTC connection failed");
  };
  pc.oniceconnectionstatechange = () => {
    reportIce(pc.iceConnectionState);
    failedAfterConnecting();
  };
  pc.onconnectionstatechange = failedAfterConnecting;
  await pc.setLocalDescription(await pc.createOffer());
  await gathered(pc, 2000);
  const timeoutMs = config.webrtc_connect_timeout_s * 1000;
  const started = performance.now();
  let response;
  try {
    response = await fetch("/api/offer", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeader() },
      body: JSON.stringify({
        type: "offer",
        sdp: option.iceBlocked ? stripCandidates(pc.localDescription.sdp) : pc.localDescription.sdp,
        config: sessionConfig(),
      }),
    });
  } catch (error) {
    throw new Error(`the offer did not reach the gateway: ${error.message}`);
  }
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const refusal = body.error || {};
    throw new Refused(`${refusal.code || response.status}: ${refusal.message || "the gateway refused the offer"}`);
  }
  state.sessionId = body.session_id;
  state.resumeToken = body.resume_token; // proves this page owns the session when it moves to WebSocket
  await pc.setRemoteDescription({ type: "answer", sdp: option.iceBlocked ? stripCandidates(body.sdp) : body.sdp });
  await connected(pc, channel, Math.max(0, timeoutMs - (performance.now() - started)));
  rtc.connected = true;
  setTransport("webrtc");
}

// WebRTC's own jitter buffer plays the track, through the <audio> element: what the user hears. (A copy through
// the page's Web Audio graph, which the page used to meter, reaches it ~30 ms later, through a FIFO that nobody
// hears: it measured the copy, not the reply.)
function playRemote(stream) {
  const audio = $("remote");
  audio.srcObject = stream;
  audio.play().catch(() => {});
}

// When the receiver handed the reply's first audible packet to the output (after Chromium's jitter buffer and
// decoder): getSynchronizationSources() says when (epoch ms) and how loud (the sender's RFC 6464 level), for the
// packet most recently delivered. The onset of sound after silence belongs to the turn waiting for its reply; it is
// heard the output device's delay later. The reply plays while loud packets keep coming (silent: 100 ms without).
function watchRtcSource() {
  if (!rtc || !rtc.receiver) return;
  const now = performance.now();
  const sincePollMs = rtc.polledAt === undefined ? 0 : now - rtc.polledAt;
  rtc.polledAt = now;
  for (const source of rtc.receiver.getSynchronizationSources()) {
    const loud = (source.audioLevel || 0) > RTC_LOUD;
    if (loud && !rtc.loud) {
      const pending = Object.values(state.turns).filter((t) => t.user_text && !t.rtc_delivered_ms && !t.interrupted);
      if (pending.length) {
        const t = pending[pending.length - 1];
        t.rtc_delivered_ms = source.timestamp;
        // The receiver names only the packet it delivered last. Polled late (Chromium runs a background tab's
        // timers once a second), the reply began up to that long before it: heard, but not timed, rather than
        // reported late.
        if (sincePollMs > RTC_POLL_LATE_MS) t.untimed_ms = sincePollMs;
        sampleRtcStats(t).then((outputDelayMs) => onPlayed(t.index, t.rtc_delivered_ms + outputDelayMs));
      }
    }
    if (loud) rtc.loudUntilMs = source.timestamp + RTC_SILENT_AFTER_MS;
    setPlaying(loud || source.timestamp < (rtc.loudUntilMs || 0));
    rtc.loud = loud;
  }
}

function closeWebRtc() {
  if (!rtc) return;
  clearInterval(rtc.sourceWatch);
  rtc.pc.close();
  rtc = null;
  $("remote").srcObject = null;
}

// ---- WebSocket ---------------------------------------------------------------------------------------------------
function startWebSocket(fallback) {
  setTransport("websocket", fallback ? "fallback" : "");
  openPlayer();
  capture.port.postMessage({ type: "frames", on: true }); // WebRTC sends the microphone's track instead
  uplinkSeq = 0;
  lastTransit = null;
  return new Promise((resolve, reject) => {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    ws = new WebSocket(`${scheme}://${location.host}/api/ws`);
    ws.binaryType = "arraybuffer";
    ws.onopen = () => {
      ws.send(JSON.stringify({ type: "start", token, config: sessionConfig(), fallback }));
      resolve();
    };
    ws.onmessage = (event) => {
      if (typeof event.data === "string") {
        onEvent(JSON.parse(event.data));
        return;
      }
      const view = new DataView(event.data);
      const sentUs = Number(view.getBigInt64(0, true));
      const turnIndex = view.getUint32(8, true);
      if (state.turns[turnIndex] && state.turns[turnIndex].interrupted) {
        state.audioAfterInterrupt += 1;
        return;
      }
      measureJitter(sentUs);
      const t = turn(turnIndex);
      if (!t.received_ms) {
        t.received_ms = performance.timeOrigin + performance.now();
        const receivedUs = Math.round(t.received_ms * 1000);
        sendControl({ type: "report", turn_index: turnIndex, first_audio_received_us: receivedUs });
        measureHops(t);
      }
      const pcm = new Int16Array(event.data.slice(HEADER_BYTES));
      player.port.postMessage({ type: "frame", turn: turnIndex, pcm }, [pcm.buffer]);
    };
    ws.onerror = () => reject(new Error("the WebSocket could not connect"));
    ws.onclose = (event) => onClosed(event.code, event.reason || (stopping ? "" : "the connection closed"));
  });
}

// ---- session -----------------------------------------------------------------------------------------------------
function sessionConfig() {
  const options = {};
  if (option.maxTokens) options.max_tokens = option.maxTokens;
  return {
    session_id: state.sessionId,
    input_sample_rate_hz: ctx.sampleRate,
    output_sample_rate_hz: ctx.sampleRate,
    system_prompt: option.systemPrompt,
    resume_token: state.resumeToken || "",
    options,
  };
}

async function fallBack(reason) {
  if (state.transport === "websocket") return;
  state.fallbackReason = reason;
  const iceState = rtc ? rtc.pc.iceConnectionState : "none";
  closeWebRtc();
  console.info(`voicemesh: WebRTC ${reason}; continuing over WebSocket`);
  try {
    await startWebSocket({ reason, ice_state: iceState });
  } catch (error) {
    showError(error.message);
    setStatus("error");
  }
}

async function start() {
  if (!["idle", "ended", "error"].includes(state.status)) return;
  showError("");
  state.closed = null;
  stopping = false;
  setStatus("connecting");
  try {
    const answer = await fetch("/api/config", { headers: authHeader() });
    if (!answer.ok) throw new Error(`the gateway refused the page's config: ${answer.status} (open the page as /#token=...)`);
    config = await answer.json();
    if (!ctx) await openAudio();
    state.sessionId = state.sessionId || crypto.randomUUID().replaceAll("-", "").slice(0, 16);
    const useWebRtc = option.transport !== "websocket" && "RTCPeerConnection" in window;
    if (!useWebRtc) {
      await startWebSocket(null);
      return;
    }
    try {
      await startWebRtc();
    } catch (error) {
      if (error instanceof Refused || option.transport === "webrtc") throw error;
      await fallBack(error.message);
    }
  } catch (error) {
    closeWebRtc();
    showError(error.message);
    setStatus("error");
  }
}

function stop() {
  if (["idle", "ended", "error"].includes(state.status)) return;
  stopping = true;
  setStatus("finishing");
  if (!sendControl({ type: "stop" })) onClosed(1000, "");
}

function teardown() {
  closeWebRtc();
  if (ws) {
    ws.onclose = null;
    ws.close();
    ws = null;
  }
  if (player) player.port.postMessage({ type: "flush" });
}

// A network that kills WebRTC mid-conversation (for trying the fallback by hand, and for the browser tests).
function simulateNetworkLoss() {
  if (state.transport === "webrtc") fallBack("connection lost (simulated)");
}

$("mic").addEventListener("click", () => (["idle", "ended", "error"].includes(state.status) ? start() : stop()));
setStatus("idle");
if (option.autostart) start();
