// Audio worklets of the voicemesh page: microphone capture in 20 ms frames with an end-of-speech detector, the
// reply player with its adaptive jitter buffer, and a level meter on that player.
// Times posted to the page are AudioContext times (seconds), which the page maps to its clock.

const FRAME_S = 0.02;

// Microphone -> 20 ms Int16 frames (posted with the context time of their first sample, once the page asks for
// them: {type: "frames", on}), plus `speech_end` (the end of the last loud frame) once `silenceS` of quiet followed it.
class MicCapture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.frameSamples = Math.round(sampleRate * FRAME_S);
    this.threshold = opts.threshold ?? 0.001;
    this.silenceS = opts.silenceS ?? 0.25;
    this.frame = new Int16Array(this.frameSamples);
    this.filled = 0;
    this.frameStart = 0;
    this.sumSquares = 0;
    this.voiced = false;
    this.lastVoicedEnd = 0;
    this.postFrames = false; // WebRTC sends the microphone's own track: only the WebSocket needs the frames
    this.port.onmessage = (event) => {
      if (event.data.type === "frames") this.postFrames = event.data.on;
    };
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true;
    const input = channels[0];
    for (let i = 0; i < input.length; i++) {
      if (this.filled === 0) this.frameStart = currentTime + i / sampleRate;
      let sample = 0;
      for (const channel of channels) sample += channel[i];
      sample /= channels.length;
      this.sumSquares += sample * sample;
      this.frame[this.filled++] = Math.max(-32768, Math.min(32767, Math.round(sample * 32768)));
      if (this.filled === this.frameSamples) this.endFrame();
    }
    return true;
  }

  endFrame() {
    const rms = Math.sqrt(this.sumSquares / this.frameSamples);
    const frameEnd = this.frameStart + FRAME_S;
    if (rms > this.threshold) {
      if (!this.voiced) this.port.postMessage({ type: "speech_start", t: this.frameStart });
      this.voiced = true;
      this.lastVoicedEnd = frameEnd;
    } else if (this.voiced && frameEnd - this.lastVoicedEnd >= this.silenceS) {
      this.voiced = false;
      this.port.postMessage({ type: "speech_end", t: this.lastVoicedEnd });
    }
    if (this.postFrames) {
      const pcm = this.frame;
      this.port.postMessage({ type: "frame", t: this.frameStart, pcm }, [pcm.buffer]);
      this.frame = new Int16Array(this.frameSamples);
    }
    this.filled = 0;
    this.sumSquares = 0;
  }
}

// Reply audio through a jitter buffer. Playback of a reply starts once `targetMs` of audio is buffered (or the
// reply is complete); an underrun mid-reply goes back to buffering and is reported, so the page can grow the
// target. `flush` drops everything at once (barge-in).
class ReplyPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.targetSamples = Math.round(((opts.targetMs ?? 160) / 1000) * sampleRate);
    this.queue = []; // {turn, samples: Float32Array, offset}
    this.buffered = 0;
    this.playing = false;
    this.endedTurns = new Set();
    this.startedTurns = new Set();
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(message) {
    if (message.type === "frame") {
      const samples = new Float32Array(message.pcm.length);
      for (let i = 0; i < samples.length; i++) samples[i] = message.pcm[i] / 32768;
      this.queue.push({ turn: message.turn, samples, offset: 0 });
      this.buffered += samples.length;
    } else if (message.type === "target") {
      this.targetSamples = Math.round((message.ms / 1000) * sampleRate);
    } else if (message.type === "end") {
      this.endedTurns.add(message.turn);
    } else if (message.type === "flush") {
      const dropped = this.buffered;
      this.queue = [];
      this.buffered = 0;
      this.setPlaying(false);
      this.port.postMessage({ type: "flushed", samples: dropped, t: currentTime });
    }
  }

  setPlaying(playing) {
    if (playing !== this.playing) {
      this.playing = playing;
      this.port.postMessage({ type: "state", playing, t: currentTime });
    }
  }

  process(inputs, outputs) {
    const output = outputs[0];
    const out = output[0];
    out.fill(0);
    if (!this.playing && this.queue.length > 0) {
      const head = this.queue[0].turn;
      if (this.buffered >= this.targetSamples || this.endedTurns.has(head)) this.setPlaying(true);
    }
    let i = 0;
    while (this.playing && i < out.length) {
      const chunk = this.queue[0];
      if (!chunk) {
        const last = this.lastTurn;
        this.setPlaying(false);
        if (!this.endedTurns.has(last)) this.port.postMessage({ type: "underrun", turn: last, t: currentTime });
        break;
      }
      if (!this.startedTurns.has(chunk.turn)) {
        this.startedTurns.add(chunk.turn);
        this.port.postMessage({ type: "started", turn: chunk.turn, t: currentTime + i / sampleRate });
      }
      const n = Math.min(out.length - i, chunk.samples.length - chunk.offset);
      out.set(chunk.samples.subarray(chunk.offset, chunk.offset + n), i);
      chunk.offset += n;
      i += n;
      this.buffered -= n;
      this.lastTurn = chunk.turn;
      if (chunk.offset === chunk.samples.length) this.queue.shift();
    }
    for (let c = 1; c < output.length; c++) output[c].set(out);
    return true;
  }
}

// Reports when the input becomes audible (`active`) and quiet again (`silent`, after `silenceS`).
class LevelMeter extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.threshold = opts.threshold ?? 0.001;
    this.silenceS = opts.silenceS ?? 0.1;
    this.active = false;
    this.lastLoud = 0;
  }

  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (!input) return true;
    let sum = 0;
    for (let i = 0; i < input.length; i++) sum += input[i] * input[i];
    const rms = Math.sqrt(sum / input.length);
    if (rms > this.threshold) {
      if (!this.active) {
        this.active = true;
        this.port.postMessage({ type: "active", t: currentTime });
      }
      this.lastLoud = currentTime;
    } else if (this.active && currentTime - this.lastLoud >= this.silenceS) {
      this.active = false;
      this.port.postMessage({ type: "silent", t: this.lastLoud });
    }
    return true;
  }
}

registerProcessor("mic-capture", MicCapture);
registerProcessor("reply-player", ReplyPlayer);
registerProcessor("level-meter", LevelMeter);
