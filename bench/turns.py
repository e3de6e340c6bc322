"""End of turn: false cut-offs against dead air, for the fixed hangover and the completeness-scored one, side by side.

The set, built from the real clips in ../shared/audio (word times from Whisper):
  complete   each clip as recorded;
  spliced    the clip with a pause of 200/400/600/800 ms spliced in at its middle word boundary;
  truncated  the clip cut at a word boundary ~60% of the way in: incomplete, it should wait;
  variants   each clip 20 and 30 dB quieter, at 48 kHz, with noise at 15 dB SNR, and as a phone line brings it
             (8 kHz G.711 mu-law);
  hesitation the clip, then "um" (Piper's voice at the speaker's level) and a 600 ms pause, then the clip again: a
             speaker who finished a sentence, hesitated and went on. A commit in the pause is a cut-off.
Each utterance (plus 2.5 s of silence) goes in real time through the ASR's RecognitionStream, built as the ASR
service builds it (Silero VAD, Whisper tiny.en, the partials' own decoder) with the Smart Turn scorer, once per
policy; the ASR's and LLM's threads are those a local mesh on this machine's cores gets (`voicemesh up`), or the
VOICEMESH_ASR_*/VOICEMESH_LLM_* settings in the environment. The `llm` policy plays the gateway's part too, through
its TurnController: partial transcripts are prefilled into the real Gemma engine while the user speaks; each
endpoint candidate starts a speculative reply, and its P(turn end) goes back to the stream as a TurnScore, at once
when a prefill already scored the candidate's words, else from the reply; the reply runs on until the user goes
on speaking, competing for the cores as it would live. `llm_probe` is the same with the LLM's learned probe as
its turn-end scorer (`turn_end_scorer=probe`); `llm_fused` and `llm_probe_fused` fuse the LLM's score with the
draft's confidence and Smart Turn's (the ASR's `turn_fusion`, services/asr/fusion.py), `llm_fused_asr` with the
draft's signals only; `llm_longest_800` and `llm_longest_600` wait at most that long after an unsure pause. Not in the default run: `llm_no_prefill` (no prefills) and `llm_reply_scores`
(prefills, but every pause waits for its reply's score). Clips are split: the thresholds were
tuned on the `tune` clips; the `check` clips say whether that generalises.

Reported per policy: the false cut-off rate (a turn committed before the utterance's speech ended) on pauses up
to 600 ms and over all; dead air (speech end -> commit, p50/p95) on complete utterances; how long truncated
utterances waited; per pause, how each signal (audio, text, fused) scored it. `python -m bench.turns`.

`python -m bench.turns --spoken tune,check,read` runs the same stream over the sentences of bench/turn_sentences.py
read by Piper instead of the clips: each whole, and cut ~60% in. One synthetic voice, but 80 sentences, none of them
heard while tuning (the thresholds saw the `tune` half's text): where the clips are four speakers, it shows how the
policy spreads. `--clip-dir DIR` builds the set from other recordings of finished utterances (split `unheard`).

Text alone, word by word and on held-out dialogue, is `python -m bench.turn_text`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import hashlib
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from bench import print_result
from gateway.turn import CancelReply, Command, Prefill, StartReply, TurnController, TurnPolicy, held_reply_tokens
from services.asr.completeness import SmartTurn, TurnScorer, text_completeness
from services.asr.engine import Transcriber
from services.asr.fusion import TurnEndFusion, TurnEndFusions
from services.asr.server import AsrSettings, RecognizerServicer
from services.asr.stream import RecognitionStream
from services.asr.vad import StreamingVad
from services.llm.engine import Engine, GenerationRequest, Message
from services.llm.server import LlmSettings, build_engine
from voicemesh import config, cpus, g711
from voicemesh.audio import Clip, read_wav, resample, speech_end_ms
from voicemesh.endpointing import EndpointingPolicy, TurnEndCalibration
from voicemesh.limits import URGENT_WORDS
from voicemesh.serving import one_blas_thread
from voicemesh.v1 import asr_pb2, audio_pb2
from voicemesh.workers import Newest

if TYPE_CHECKING:
    from services.tts.piper_engine import PiperEngine

ROOT = Path(__file__).resolve().parents[1]
CLIPS = ROOT.parent / "shared" / "audio"
SPLIT = {"spk1_snt1": "tune", "wizard": "tune", "jfk": "tune", "spk2_snt1": "check", "horizon": "check"}
SPLICE_MS = (200, 400, 600, 800)
SESSION = "bench-turns"
REPLY_TOKENS = 24  # a speculative reply's length (the gateway's would be longer; what counts is the CPU at its start)
HESITATION_PAUSE_MS = 600
FILLER_TEXT = "Um..."
LONG_PAUSE_CLIPS = {"jfk"}  # natural pauses of ~1.1 s inside the sentence
TRAILING_S = 2.5
FRAME_MS = 20


class Policy(NamedTuple):
    endpointing: EndpointingPolicy
    audio: bool  # scored with the audio model too
    llm: bool  # scored by the LLM as the gateway does
    prefill: bool = True  # with llm: the partials' words prefilled while the user speaks, as the gateway does
    prefill_scores: bool = True  # with prefill: a candidate whose words a prefill scored takes that score at once
    start_on_partials: bool = True  # with prefill: a partial whose prefill scores finished starts the reply at once
    scorer: str = ""  # with llm: the LLM's turn-end scorer (turn_end_scorer); empty: the configured one
    fused: bool = False  # with llm: its score fused with the ASR's confidence and the audio's (turn_fusion)


POLICIES = {
    "fixed_288": Policy(EndpointingPolicy(fixed_hangover=True), False, False),
    "text": Policy(EndpointingPolicy(), False, False),
    "audio_text": Policy(EndpointingPolicy(), True, False),
    "llm": Policy(EndpointingPolicy(), False, True),
    "llm_probe": Policy(EndpointingPolicy(), False, True, scorer="probe"),  # the learned probe
    "llm_fused": Policy(EndpointingPolicy(), True, True, fused=True),  # turn_model=smart-turn, turn_fusion=SCORER
    "llm_probe_fused": Policy(EndpointingPolicy(), True, True, scorer="probe", fused=True),
    "llm_fused_asr": Policy(EndpointingPolicy(), False, True, fused=True),  # turn_fusion=SCORER, no audio model
    # The longest wait shortened (a session's endpointing.max_hangover_ms; the Realtime door's eagerness "high": 600).
    "llm_longest_800": Policy(EndpointingPolicy(max_hangover_ms=800), False, True),
    "llm_longest_600": Policy(EndpointingPolicy(max_hangover_ms=600), False, True),
    # Not in the default run: without prefills; with them, but every pause waiting for its reply's score.
    "llm_no_prefill": Policy(EndpointingPolicy(), False, True, prefill=False),
    "llm_reply_scores": Policy(EndpointingPolicy(), False, True, prefill_scores=False),
    "llm_no_partial_start": Policy(EndpointingPolicy(), False, True, start_on_partials=False),
}
DEFAULT_POLICIES = ("fixed_288", "text", "audio_text", "llm", "llm_fused")


@dataclass
class Utterance:
    name: str
    clip: str
    kind: str  # complete | spliced | truncated | quiet20 | quiet30 | rate48k | noise15 | phone8k
    audio: np.ndarray  # float32 at rate_hz
    rate_hz: int
    speech_end_ms: float  # where the speaker actually stopped
    pause_ms: int = 0  # the spliced pause's length (spliced only)
    split: str = ""  # tune | check | read | unheard; empty: the clip's (SPLIT)


@dataclass(frozen=True)
class FinalTranscript:
    """A final transcript the ASR committed; the field names are the JSON keys under `per_utterance`."""

    text: str
    committed_ms: int  # audio received when it committed, from the utterance's start
    speech_end_ms: float  # where the speaker actually stopped
    vad_speech_end_ms: int  # where the ASR's VAD heard the speech stop
    completeness: float
    hangover_ms: int
    score_ms: float  # first silent window -> the pause's score in (a language model's, if one came first)
    draft_ms: float  # the final's decode, queue and compute: started at the first silent window


@dataclass(frozen=True)
class PauseScores:
    """How each signal scored one pause (None: no score); the field names are the JSON keys."""

    audio: float | None
    text: float | None
    fused: float | None
    transcript: str

    def signals(self) -> dict[str, float | None]:
        return {"audio": self.audio, "text": self.text, "fused": self.fused}


@dataclass
class Outcome:
    utterance: str
    clip: str
    split: str
    kind: str
    pause_ms: int
    finals: list[FinalTranscript] = field(default_factory=list)
    pauses: list[PauseScores] = field(default_factory=list)
    llm_scores: list[tuple[str, float]] = field(default_factory=list)  # (candidate, P(turn end)) per scored pause
    prefill_scores: int = 0  # of those, scored by the prefill of a partial with the candidate's words
    early_replies: int = 0  # replies started on a partial (held to their first words until a pause confirms them)

    @property
    def cut_off(self) -> bool:
        return any(f.committed_ms < f.speech_end_ms for f in self.finals)

    @property
    def dead_air_ms(self) -> float | None:
        after = [f for f in self.finals if f.committed_ms >= f.speech_end_ms]
        return after[0].committed_ms - after[0].speech_end_ms if after else None


def filler_audio() -> np.ndarray:
    """A hesitation, "um", as Piper (en_US-joe-medium) says it, at 16 kHz from its first to its last sound."""
    audio = _piper_says(FILLER_TEXT)
    return audio[: int(speech_end_ms(audio, 16000) * 16)]


def build_set(transcriber: Transcriber, clip_names: list[str], directory: Path = CLIPS) -> list[Utterance]:
    """The set from each clip `directory/NAME.wav`; clips from elsewhere than ../shared/audio are split `unheard`."""
    rng = np.random.default_rng(7)
    utterances: list[Utterance] = []
    filler = filler_audio()
    for name in clip_names:
        audio = read_wav(directory / f"{name}.wav").to_rate(16000).samples
        end_ms = speech_end_ms(audio, 16000)
        words = transcriber.transcribe(audio[: int((end_ms / 1000 + 0.3) * 16000)]).words
        noise_floor = float(np.sqrt(np.mean(audio[: int(0.05 * 16000)] ** 2)) + 1e-5)
        utterances.append(Utterance(f"{name}", name, "complete", audio, 16000, end_ms))
        # A pause spliced in at the middle word boundary (room tone at the clip's own floor, not digital zeros).
        middle = len(words) // 2
        boundary_s = (words[middle - 1].end_s + words[middle].start_s) / 2
        cut = int(boundary_s * 16000)
        for pause_ms in SPLICE_MS:
            tone = (rng.standard_normal(pause_ms * 16) * noise_floor).astype(np.float32)
            spliced = np.concatenate([audio[:cut], tone, audio[cut:]])
            utterances.append(
                Utterance(f"{name}+{pause_ms}ms", name, "spliced", spliced, 16000, end_ms + pause_ms, pause_ms)
            )
        # Cut at a word boundary ~60% in: the speaker stops mid-sentence.
        stop = words[max(1, int(len(words) * 0.6)) - 1]
        truncated = audio[: int((stop.end_s + 0.03) * 16000)]
        utterances.append(
            Utterance(f"{name}/cut", name, "truncated", truncated, 16000, speech_end_ms(truncated, 16000))
        )
        for db in (20, 30):
            quiet = (audio * 10 ** (-db / 20)).astype(np.float32)
            utterances.append(Utterance(f"{name}-{db}dB", name, f"quiet{db}", quiet, 16000, end_ms))
        utterances.append(Utterance(f"{name}@48k", name, "rate48k", resample(audio, 16000, 48000), 48000, end_ms))
        speech_rms = float(np.sqrt(np.mean(audio[: int(end_ms * 16)] ** 2)))
        noisy = audio + (rng.standard_normal(len(audio)) * speech_rms * 10 ** (-15 / 20)).astype(np.float32)
        utterances.append(Utterance(f"{name}+noise", name, "noise15", noisy.astype(np.float32), 16000, end_ms))
        # A phone line: 8 kHz, G.711 mu-law, as a carrier's media stream brings it.
        phone = g711.telephone_band(Clip(audio, 16000)).samples
        utterances.append(Utterance(f"{name}@8k-ulaw", name, "phone8k", phone, 8000, end_ms))
        said = audio[: int((end_ms + 30) * 16)]
        um = (filler * speech_rms / float(np.sqrt(np.mean(filler**2)))).astype(np.float32)
        tone = (rng.standard_normal(HESITATION_PAUSE_MS * 16) * noise_floor).astype(np.float32)
        hesitant = np.concatenate([said, um, tone, audio])
        went_on_ms = (len(said) + len(um) + len(tone)) / 16
        utterances.append(
            Utterance(f"{name}+um", name, "hesitation", hesitant, 16000, went_on_ms + end_ms, HESITATION_PAUSE_MS)
        )
    if directory != CLIPS:
        for utterance in utterances:
            utterance.split = "unheard"
    return utterances


SPOKEN_CACHE = Path.home() / ".cache" / "voicemesh" / "bench-spoken"


def spoken_set(transcriber: Transcriber, splits: list[str]) -> list[Utterance]:
    """The sentences of bench/turn_sentences.py read by Piper (en_US-joe-medium) over room tone: each whole
    (`complete`), and cut at a word boundary ~60% in (`truncated`: the voice goes on in the middle of the sentence,
    so it should wait). Many more utterances than ../shared/audio holds, and none of them heard while tuning
    (but the `tune` half's text); one synthetic voice, so a second opinion, not a substitute for real speech.

    Piper's reading varies from run to run (its pauses and timing are sampled), so each reading is kept under
    SPOKEN_CACHE and reused: two runs, before and after a change, hear the same audio. Delete it for new readings."""
    from bench.turn_sentences import CHECK, READ, TUNE

    sentences = {"tune": TUNE, "check": CHECK, "read": READ}
    rng = np.random.default_rng(11)
    utterances: list[Utterance] = []
    for split in splits:
        for index, sentence in enumerate(sentences[split]):
            speech = _reading(sentence)
            tone = (rng.standard_normal(len(speech) + 4800) * 10 ** (-60 / 20)).astype(np.float32)  # -60 dBFS
            audio = tone.copy()
            audio[4800:] += speech  # 300 ms of room tone, then the sentence
            name = f"{split}{index:02d}"
            end_ms = speech_end_ms(audio, 16000)
            utterances.append(Utterance(name, name, "complete", audio, 16000, end_ms, split=split))
            words = transcriber.transcribe(audio).words
            if len(words) >= 3:
                stop = words[max(1, int(len(words) * 0.6)) - 1]
                truncated = audio[: int((stop.end_s + 0.03) * 16000)]
                utterances.append(
                    Utterance(
                        f"{name}/cut", name, "truncated", truncated, 16000, speech_end_ms(truncated, 16000), split=split
                    )
                )
    return utterances


def _reading(sentence: str) -> np.ndarray:
    """Piper's reading of `sentence` at 16 kHz, first to last sound (from SPOKEN_CACHE when read before)."""
    path = SPOKEN_CACHE / f"{hashlib.sha256(sentence.encode()).hexdigest()[:16]}.npy"
    if path.exists():
        return np.load(path)
    speech = _piper_says(sentence).astype(np.float32)
    speech = speech[: int((speech_end_ms(speech, 16000) + 30) * 16)]
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, speech)
    return speech


def _piper_says(text: str) -> np.ndarray:
    """Piper's reading of `text` at 16 kHz, from its first sound."""
    from services.tts.server import from_first_sound_of

    engine = _piper()
    rate_hz = engine.capabilities.voices[0].sample_rate_hz
    return resample(from_first_sound_of(np.concatenate(list(engine.synthesize(text))), rate_hz), rate_hz, 16000)


@functools.cache
def _piper() -> PiperEngine:
    """Piper (en_US-joe-medium) on one thread, loaded once for the filler and the spoken set."""
    from services.tts.piper_engine import PiperEngine

    return PiperEngine(intra_op_threads=1)


class RecordingScorer(TurnScorer):
    """The real scorer, also keeping each signal apart so the bench can say how each one did."""

    def __init__(self, audio_model: SmartTurn | None, learned: TurnEndFusion | None = None) -> None:
        super().__init__(audio_model, learned=learned)
        self.records: list[PauseScores] = []

    def fuse(self, audio_score: float | None, text: str) -> float | None:
        fused = super().fuse(audio_score, text)
        self.records.append(PauseScores(audio_score, text_completeness(text), fused, text))
        return fused


class LlmScorer:
    """The gateway's part, through the gateway's own `TurnController`: each endpoint candidate starts a speculative
    reply from the real LLM engine, which scores the turn end first; the score goes back to the stream, and the reply
    runs on until the controller cancels it (the user went on speaking) or it ends, its CPU competing as it would
    live. With `prefill`, the partials' words go to the engine while the user speaks, as the controller decides."""

    def __init__(self, engine: Engine, calibration: TurnEndCalibration) -> None:
        self.engine = engine
        self.calibration = calibration  # the engine's model's, applied as the LLM service applies it
        self.scores: list[tuple[str, float]] = []
        self.scored_by_prefill = 0  # pauses scored by a prefill of the candidate's words, not by its reply
        self.prefill_scores = True
        self._replies: dict[int, asyncio.Task[None]] = {}
        self._reply_scores: dict[int, float] = {}  # reply id -> its P(turn end), once in
        self._reply_pauses: dict[int, int] = {}  # reply id -> the pause its score goes to
        self._confirmed: dict[int, asyncio.Event] = {}  # reply id (started on a partial) -> a pause has its words
        self.turns = TurnController(TurnPolicy(prefill_partials=False))
        self._stream: RecognitionStream | None = None
        self._prefills = Newest(self._prefill, held=lambda: bool(self._replies))  # one at a time, as the gateway

    def new_utterance(self, policy: Policy) -> None:
        self.prefill_scores = policy.prefill_scores
        self.scores.clear()
        self.scored_by_prefill = 0
        self._reply_scores.clear()
        self._reply_pauses.clear()
        self._confirmed.clear()
        self.turns = TurnController(
            TurnPolicy(prefill_partials=policy.prefill, start_on_partials=policy.start_on_partials)
        )

    def on_event(self, stream: RecognitionStream, event: asr_pb2.RecognizeEvent) -> None:
        self._stream = stream
        kind = event.WhichOneof("event")
        if kind == "partial":
            commands = self.turns.on_partial(0, event.partial.text)
        elif kind == "speech_resumed":
            commands = self.turns.on_speech_resumed(0)
        elif kind == "endpoint_candidate":
            candidate = event.endpoint_candidate
            commands = self.turns.on_candidate(0, candidate.text.strip())
            if not any(isinstance(c, StartReply) for c in commands):
                self._rescore(stream, candidate.pause_id)
        elif kind == "final":
            commands = self.turns.on_final(0, event.final.text.strip())
        else:
            return
        self._apply(stream, commands, event.endpoint_candidate.pause_id)

    def _apply(self, stream: RecognitionStream, commands: list[Command], pause_id: int = 0) -> None:
        """`pause_id`: the candidate's, for a reply it starts (0: started on a partial, before any pause)."""
        for command in commands:
            if isinstance(command, Prefill):
                self._prefills.offer(command.user_text)
            elif isinstance(command, StartReply) and command.speculative:
                reply_id = command.reply_id
                self._reply_pauses[reply_id] = pause_id
                if command.turn_end is not None and self.prefill_scores:  # a prefill scored these words: now
                    self.scored_by_prefill += 1
                    self._scored(stream, reply_id, command.user_text, command.turn_end)
                if not pause_id:  # started on a partial: held to its first words until a pause confirms them
                    self._confirmed[reply_id] = asyncio.Event()
                task = asyncio.ensure_future(self._reply(stream, reply_id, command.user_text))
                self._replies[reply_id] = task
                task.add_done_callback(lambda _, r=reply_id: self._replies.pop(r, None))
            elif isinstance(command, CancelReply) and (task := self._replies.get(command.reply_id)) is not None:
                task.cancel()

    def _rescore(self, stream: RecognitionStream, pause_id: int) -> None:
        """A candidate with the speculative reply's words: that reply scores this pause too, as in the gateway."""
        speculative = self.turns.speculative
        reply_id = speculative[0] if speculative is not None else None
        # A reply started on a partial may have written all its words before the speech stopped: it is the
        # controller's speculative reply still (as in the gateway), and its score stands.
        if reply_id is None or (reply_id not in self._replies and reply_id not in self._reply_scores):
            stream.turn_score(asr_pb2.TurnScore(pause_id=pause_id, declined=True))
            return
        self._reply_pauses[reply_id] = pause_id
        if (confirmed := self._confirmed.get(reply_id)) is not None:
            confirmed.set()
        if (probability := self._reply_scores.get(reply_id)) is not None:
            stream.turn_score(asr_pb2.TurnScore(pause_id=pause_id, probability=probability))

    async def _prefill(self, user_text: str) -> None:
        done = await self.engine.prefill(SESSION, [Message("user", user_text)])
        turn_end = None if done.turn_end is None else self.calibration.standard(done.turn_end)
        commands = self.turns.on_prefilled(user_text, turn_end if self.prefill_scores else None)
        if self._stream is not None:
            self._apply(self._stream, commands)  # a score that says the turn is finished starts the reply

    def _scored(self, stream: RecognitionStream, reply_id: int, text: str, probability: float) -> None:
        self.scores.append((text, probability))
        self._reply_scores[reply_id] = probability
        if pause_id := self._reply_pauses[reply_id]:  # else started on a partial: the candidate gets it (_rescore)
            stream.turn_score(asr_pb2.TurnScore(pause_id=pause_id, probability=probability))

    async def _reply(self, stream: RecognitionStream, reply_id: int, text: str) -> None:
        """The reply's CPU as the gateway spends it: a reply started on a partial writes its first words, and the rest
        (as a continuation) only once a pause has its words."""
        scored = reply_id in self._reply_scores
        confirmed = self._confirmed.get(reply_id)
        max_tokens = REPLY_TOKENS if confirmed is None else held_reply_tokens(URGENT_WORDS.default)
        request = GenerationRequest(SESSION, [Message("user", text)], max_tokens=max_tokens, score_turn_end=not scored)
        said, written = [], 0
        async for chunk in self.engine.generate(request):
            if chunk.turn_end is not None:
                scored = True
                self._scored(stream, reply_id, text, self.calibration.standard(chunk.turn_end))
            elif not scored:
                scored = True
                stream.turn_score(asr_pb2.TurnScore(pause_id=self._reply_pauses[reply_id], declined=True))
            said.append(chunk.text)
            written = chunk.completion_tokens or written
        if confirmed is None or written < max_tokens:
            return
        await confirmed.wait()
        rest = GenerationRequest(
            SESSION, [Message("user", text)], max_tokens=REPLY_TOKENS - written, reply_prefix="".join(said)
        )
        async for _ in self.engine.generate(rest):
            pass

    @property
    def early_replies(self) -> int:
        """Replies of this utterance started on a partial."""
        return len(self._confirmed)

    async def settle(self) -> None:
        for task in list(self._replies.values()):
            task.cancel()
        await asyncio.gather(*self._replies.values(), self._prefills.close(), return_exceptions=True)


async def run_one(
    utterance: Utterance,
    bench_policy: Policy,
    asr: RecognizerServicer,
    scorer: RecordingScorer,
    llm: LlmScorer | None = None,
) -> Outcome:
    """`llm`: the gateway's part (`bench_policy.llm`), else no LLM scores."""
    policy = bench_policy.endpointing
    events: list[asr_pb2.RecognizeEvent] = []
    recognition = asr_pb2.RecognitionConfig(  # as the gateway asks
        session_id="bench",
        sample_rate_hz=utterance.rate_hz,
        interim_results=True,
        skip_word_timings=True,
        turn_scores=llm is not None,
    )

    def emit(event: asr_pb2.RecognizeEvent) -> None:
        events.append(event)
        if llm is not None:
            llm.on_event(stream, event)

    assert asr.transcriber is not None
    vad = StreamingVad(asr.vad_session)
    stream = RecognitionStream(recognition, policy, vad, asr.transcriber, asr.pool, emit, scorer, partials=asr.partials)
    if llm is not None:
        llm.new_utterance(bench_policy)
    audio = np.concatenate([utterance.audio, np.zeros(int(TRAILING_S * utterance.rate_hz), np.float32)])
    frames = Clip(audio, utterance.rate_hz).frames(FRAME_MS)
    scorer.records.clear()
    loop = asyncio.get_running_loop()
    start = loop.time()
    for seq, data in enumerate(frames):  # real time: the scorer's and decoder's latency count as they would live
        await asyncio.sleep(max(0.0, start + seq * FRAME_MS / 1000 - loop.time()))
        stream.push_frame(audio_pb2.AudioFrame(data=data, seq=seq, sample_rate_hz=utterance.rate_hz))
    await stream.drain()
    if llm is not None:
        await llm.settle()
    outcome = Outcome(
        utterance.name,
        utterance.clip,
        utterance.split or SPLIT.get(utterance.clip, "check"),
        utterance.kind,
        utterance.pause_ms,
    )
    for event in events:
        if event.WhichOneof("event") == "final" and event.final.text.strip():
            outcome.finals.append(
                FinalTranscript(
                    text=event.final.text,
                    committed_ms=event.audio_received_ms,
                    speech_end_ms=utterance.speech_end_ms,
                    vad_speech_end_ms=event.speech_end_ms,
                    completeness=round(event.final.completeness, 3),
                    hangover_ms=event.final.hangover_ms,
                    score_ms=round(event.final.score_ms, 1),
                    draft_ms=round(event.timing.queue_ms + event.timing.compute_ms, 1),
                )
            )
    outcome.pauses = list(scorer.records)
    outcome.llm_scores = list(llm.scores) if llm is not None else []
    outcome.prefill_scores = llm.scored_by_prefill if llm is not None else 0
    outcome.early_replies = llm.early_replies if llm is not None else 0
    return outcome


def summarize(outcomes: list[Outcome]) -> dict[str, object]:
    def rate(rows: list[Outcome]) -> dict[str, object]:
        cut = sum(o.cut_off for o in rows)
        return {"cut_off": cut, "of": len(rows), "rate": round(cut / len(rows), 3) if rows else None}

    def air(rows: list[Outcome]) -> dict[str, object]:
        values = [a for o in rows if (a := o.dead_air_ms) is not None]
        if not values:
            return {"n": 0}
        return {
            "n": len(values),
            "p50_ms": round(float(np.percentile(values, 50)), 1),
            "p95_ms": round(float(np.percentile(values, 95)), 1),
            "max_ms": round(max(values), 1),
        }

    whole = [o for o in outcomes if o.kind not in ("truncated", "hesitation")]
    # jfk.wav pauses 1.1 s twice on its own: it belongs with the long pauses, not with "up to 600 ms".
    up_to_600 = [o for o in whole if o.clip not in LONG_PAUSE_CLIPS and (o.kind != "spliced" or o.pause_ms <= 600)]
    complete = [o for o in whole if o.kind != "spliced"]
    hesitant = [o for o in outcomes if o.kind == "hesitation"]
    truncated = [o for o in outcomes if o.kind == "truncated"]
    summary: dict[str, object] = {
        "false_cutoffs_pauses_up_to_600ms": rate(up_to_600),
        "false_cutoffs_all": rate(whole),
        "dead_air_complete": air(complete),
        "false_cutoffs_long_natural_pauses": rate([o for o in whole if o.clip in LONG_PAUSE_CLIPS]),
        "false_cutoffs_by_pause_ms": {
            str(ms): rate(
                [o for o in whole if o.kind == "spliced" and o.pause_ms == ms and o.clip not in LONG_PAUSE_CLIPS]
            )
            for ms in SPLICE_MS
        },
        "false_cutoffs_after_hesitation": rate(hesitant),
        "truncated_wait_ms": [round(a, 1) if (a := o.dead_air_ms) is not None else None for o in truncated],
        "missed": [o.utterance for o in whole if not o.finals],
        "llm_scores": sum(len(o.llm_scores) for o in outcomes),
        "llm_scores_from_prefill": sum(o.prefill_scores for o in outcomes),
        "replies_started_on_partials": sum(o.early_replies for o in outcomes),
    }
    for split in ("tune", "check", "read", "unheard"):
        rows = [o for o in up_to_600 if o.split == split]
        if not rows:
            continue
        summary[f"{split}_false_cutoffs_up_to_600ms"] = rate(rows)
        summary[f"{split}_dead_air_complete"] = air([o for o in rows if o.kind != "spliced"])
    return summary


def signal_quality(outcomes: list[Outcome]) -> dict[str, object]:
    """Each signal at each pause that was scored: a pause at the speech end is 'complete', one inside is not."""
    rows: dict[str, dict[str, list[float]]] = {
        s: {"complete": [], "incomplete": []} for s in ("audio", "text", "fused", "llm")
    }
    for outcome in outcomes:
        if outcome.kind == "truncated":
            continue
        for index, pause in enumerate(outcome.pauses):
            final_pause = index == len(outcome.pauses) - 1 and not outcome.cut_off
            label = "complete" if final_pause else "incomplete"
            for signal, value in pause.signals().items():
                if value is not None:
                    rows[signal][label].append(float(value))
        for index, (_, probability) in enumerate(outcome.llm_scores):
            final_pause = index == len(outcome.llm_scores) - 1 and not outcome.cut_off
            rows["llm"]["complete" if final_pause else "incomplete"].append(probability)
    rows = {signal: groups for signal, groups in rows.items() if groups["complete"] or groups["incomplete"]}
    report: dict[str, object] = {}
    for signal, groups in rows.items():
        complete, incomplete = groups["complete"], groups["incomplete"]
        report[signal] = {
            "complete_pauses": len(complete),
            "incomplete_pauses": len(incomplete),
            "complete_called_complete_at_0.5": sum(v >= 0.5 for v in complete),
            "incomplete_called_incomplete_at_0.5": sum(v < 0.5 for v in incomplete),
            "mean_complete": round(statistics.mean(complete), 3) if complete else None,
            "mean_incomplete": round(statistics.mean(incomplete), 3) if incomplete else None,
        }
    return report


async def measure(
    clip_names: list[str],
    policies: list[str],
    kinds: set[str] | None,
    spoken: list[str] | None = None,
    directory: Path = CLIPS,
) -> dict[str, object]:
    # The services' settings as a local mesh on this machine's cores runs them (voicemesh up), then the environment's.
    split = {k: str(v) for k, v in cpus.thread_split(cpus.available_cpus()).items()}
    env = split | dict(os.environ)
    asr = RecognizerServicer(config.build(AsrSettings, "asr", env=env))  # its models, pool and partial decoder
    asr.load()
    assert asr.transcriber is not None
    transcriber = asr.transcriber
    smart_turn = SmartTurn(threads=1)
    scorers = {(False, ""): RecordingScorer(None), (True, ""): RecordingScorer(smart_turn)}
    llm_settings = config.build(LlmSettings, "llm", env=env)
    for name in policies:
        if POLICIES[name].fused:
            text, audio = POLICIES[name].scorer or llm_settings.turn_end_scorer, POLICIES[name].audio
            fusion = TurnEndFusions.load().pick(text, audio=audio)
            scorers[(audio, text)] = RecordingScorer(smart_turn if audio else None, fusion)
    llms: dict[str, LlmScorer] = {}
    for scorer_name in {POLICIES[p].scorer or llm_settings.turn_end_scorer for p in policies if POLICIES[p].llm}:
        engine = build_engine(dataclasses.replace(llm_settings, turn_end_scorer=scorer_name))  # as the service does
        await engine.start()
        llms[scorer_name] = LlmScorer(engine, engine.turn_end_calibration)
    built = spoken_set(transcriber, spoken) if spoken else build_set(transcriber, clip_names, directory)
    utterances = [u for u in built if kinds is None or u.kind in kinds]
    results: dict[str, object] = {"utterances": len(utterances)}
    per_policy: dict[str, list[Outcome]] = {p: [] for p in policies}
    for utterance in utterances:  # policies interleaved per utterance: drift in machine load hits both alike
        for name in policies:
            policy = POLICIES[name]
            text = policy.scorer or llm_settings.turn_end_scorer
            scorer = scorers[(policy.audio, text if policy.fused else "")]
            llm = llms[text] if policy.llm else None
            outcome = await run_one(utterance, policy, asr, scorer, llm)
            per_policy[name].append(outcome)
    for name, outcomes in per_policy.items():
        results[name] = summarize(outcomes)
        if POLICIES[name].audio or POLICIES[name].llm:
            results[f"signals_{name}"] = signal_quality(outcomes)
    results["per_utterance"] = {
        name: [
            {
                "utterance": o.utterance,
                "split": o.split,
                "cut_off": o.cut_off,
                "dead_air_ms": None if o.dead_air_ms is None else round(o.dead_air_ms, 1),
                "finals": [asdict(f) for f in o.finals],
                "pauses": [asdict(p) for p in o.pauses],
                "llm_scores": [{"candidate": text, "p_turn_end": round(p, 4)} for text, p in o.llm_scores],
                "prefill_scores": o.prefill_scores,
                "replies_started_on_partials": o.early_replies,
            }
            for o in outcomes
        ]
        for name, outcomes in per_policy.items()
    }
    for scorer in scorers.values():
        scorer.close()
    for llm in llms.values():
        await llm.engine.close()
    return results


def run(
    clips: list[str] | None = None,
    policies: list[str] | None = None,
    kinds: set[str] | None = None,
    spoken: list[str] | None = None,
    directory: Path = CLIPS,
) -> dict[str, object]:
    if directory != CLIPS:
        names = sorted(path.stem for path in directory.glob("*.wav"))
    else:
        names = [c for c in (clips or list(SPLIT)) if (CLIPS / f"{c}.wav").exists()]
    if not names and not spoken:
        return {"skipped": f"no clips under {directory}"}
    one_blas_thread()  # as the ASR and LLM services do when they serve
    return asyncio.run(measure(names, policies or list(DEFAULT_POLICIES), kinds, spoken, directory))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", default=",".join(SPLIT))
    parser.add_argument(
        "--clip-dir",
        type=Path,
        default=CLIPS,
        help="instead of ../shared/audio: every recorded finished utterance (16-bit WAV) here, split `unheard`",
    )
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help=f"of {','.join(POLICIES)}")
    parser.add_argument("--kinds", default="", help="only these kinds (complete,spliced,truncated,quiet20,...)")
    parser.add_argument("--per-utterance", action="store_true", help="include every utterance in the output")
    parser.add_argument(
        "--spoken", default="", help="instead of the clips: bench/turn_sentences.py read by Piper (tune,check,read)"
    )
    args = parser.parse_args()
    kinds = set(args.kinds.split(",")) if args.kinds else None
    spoken = [s for s in args.spoken.split(",") if s]
    if unknown := set(spoken) - {"tune", "check", "read"}:
        parser.error(f"--spoken takes tune, check and read, not {','.join(sorted(unknown))}")
    result = run(args.clips.split(","), args.policies.split(","), kinds, spoken, args.clip_dir)
    print_result(result, drop=None if args.per_utterance else "per_utterance")


if __name__ == "__main__":
    main()
