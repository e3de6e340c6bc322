"""How finished an utterance sounds at a pause, 0-1: the transcript's ending, optionally fused with an audio
end-of-turn model (Smart Turn v3.2). voicemesh/endpointing.py maps the score to a hangover.

The transcript is the default signal: it is there anyway (the final decode starts at the pause) and costs nothing.
The audio model costs CPU at every pause and, scored at the first silent window of read speech, did not separate
finished sentences from mid-sentence pauses (docs/decisions/0005).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime
from faster_whisper.feature_extractor import FeatureExtractor

from services.asr.engine import Transcript
from services.asr.fusion import TurnEndFusion, features_of
from voicemesh.endpointing import lm_completeness
from voicemesh.evaluation import words_of

SAMPLE_RATE_HZ = 16000
SMART_TURN_FILE = "smart-turn-v3.2-cpu.onnx"
SMART_TURN_PACKAGE = "pipecat-ai"
SMART_TURN_WINDOW_S = 8

# Words after which a speaker is almost never done: conjunctions, prepositions, articles, fillers, auxiliaries.
CONTINUATION_WORDS = frozenset(
    """and but or nor so because since although though while whereas if unless until when whenever where
    which who whom whose that than then as like the a an my your his her its our their this these those some
    any every no of to in on at for from with without about into onto over under between through after before
    during against among by um uh er erm ah is are was were be been being am do does did have has had will
    would shall should can could may might must i we you he she they it's i'm let's very really just also
    not""".split()
)
FILLER_WORDS = frozenset({"um", "umm", "uhm", "uh", "uhh", "er", "erm", "ehm"})
"""Filled pauses: a speaker who ends on one is thinking, not done ("The child almost hurt the small dog. Um."). Not
the hums ("mm", "hmm"), which are whole answers too ("Mm-hmm.")."""


LOW_CONFIDENCE_LOGPROB = -1.0
"""Whisper's own threshold (its `log_prob_threshold`): a decode whose tokens average below it is not to be trusted."""


def doubted(transcript: Transcript) -> str | None:
    """Why a draft transcript cannot be taken for a finished sentence, whatever a language model makes of its words
    (None: nothing against it). A garbled, empty or filler-only line must never take the short wait. Whisper's
    no-speech probability is no reason: at a pause it is as high after finished lines as inside them (0037)."""
    words = words_of(transcript.text)
    if not words:
        return "no_words"
    if all(word in FILLER_WORDS for word in words):  # a hum ("Mm-hmm.") is a whole answer, a filler is not
        return "fillers_only"
    if words[-1] in FILLER_WORDS:
        return "ends_in_filler"
    if transcript.avg_logprob and transcript.avg_logprob < LOW_CONFIDENCE_LOGPROB:
        return "low_confidence"
    if len(words) == 1 and transcript.words and transcript.words[-1].probability < 0.5:
        return "one_unsure_word"
    return None


def smart_turn_path() -> Path:
    """Smart Turn v3.2 (Daily, BSD-2-Clause) as shipped inside the `pipecat-ai` wheel, found without importing
    pipecat (its dependencies are not installed: `pip install --no-deps pipecat-ai`)."""
    try:
        files = importlib.metadata.files(SMART_TURN_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as error:
        raise FileNotFoundError(
            f"the Smart Turn model comes from the {SMART_TURN_PACKAGE} wheel: "
            f"pip install --no-deps {SMART_TURN_PACKAGE}==1.14.0 (or run the ASR with --turn-model text)"
        ) from error
    for file in files:
        if file.name == SMART_TURN_FILE:
            return Path(str(file.locate()))
    raise FileNotFoundError(f"{SMART_TURN_FILE} is not in the installed {SMART_TURN_PACKAGE}; reinstall it")


class SmartTurn:
    """The Smart Turn v3 audio model: the last 8 s of a turn's audio in, P(the speaker has finished) out.

    ~50 ms per call on one core. Its Whisper-style features are taken from a level-normalized waveform, so a
    quiet speaker scores like a loud one.
    """

    def __init__(self, path: Path | None = None, threads: int = 1) -> None:
        options = onnxruntime.SessionOptions()
        # One thread: the score runs beside Whisper's final decode, which needs the other cores.
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        self._session = onnxruntime.InferenceSession(
            str(path or smart_turn_path()), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._features = FeatureExtractor(feature_size=80, sampling_rate=SAMPLE_RATE_HZ, chunk_length=8)

    def probability(self, audio: np.ndarray) -> float:
        """P(complete) for 16 kHz float32 audio ending at the pause (only its last 8 s count)."""
        window = SMART_TURN_WINDOW_S * SAMPLE_RATE_HZ
        audio = np.asarray(audio, dtype=np.float32)[-window:]
        audio = np.pad(audio, (window - len(audio), 0))  # the model was trained with leading zero padding
        audio = (audio - audio.mean()) / np.sqrt(audio.var() + 1e-7)
        features = self._features(audio, padding=0)[:, : SMART_TURN_WINDOW_S * 100]
        (output,) = self._session.run(None, {"input_features": features[None, :, :].astype(np.float32)})
        return float(np.asarray(output).reshape(-1)[0])


def text_completeness(text: str) -> float | None:
    """How finished a transcript reads, from its ending: Whisper punctuates what it hears as a sentence end.

    None when there are no words (nothing to judge)."""
    words = words_of(text)
    if not words:
        return None
    stripped = text.rstrip()
    if words[-1] in CONTINUATION_WORDS:
        return 0.1
    if stripped.endswith("..."):
        return 0.2  # Whisper's trailing ellipsis: the voice trailed off mid-thought
    if stripped[-1:] in "?!":
        return 0.95
    if stripped[-1:] == ".":
        return 0.8
    if stripped[-1:] in ",;:-":
        return 0.15
    return 0.4  # no punctuation at all: Whisper was not sure either


@dataclass(frozen=True)
class Fusion:
    """The weighted mean of the two signals; either alone when the other is missing.

    Text weighs more (1:3): the transcript's ending calls every finished sentence complete but also many clause
    ends (Whisper puts a full stop after "The child almost hurt"), and Smart Turn alone misses most finished read
    sentences; fused, each vetoes the other's mistakes (docs/decisions/0005)."""

    audio_weight: float = 0.25

    def score(self, audio: float | None, text: float | None) -> float | None:
        if audio is None or text is None:
            return audio if text is None else text
        return self.audio_weight * audio + (1 - self.audio_weight) * text


class TurnScorer:
    """Scores pauses for every stream of a server: the audio model on a thread of its own (so it runs beside the
    Whisper draft decode rather than behind it), then the fusion with the draft's transcript."""

    def __init__(
        self, audio_model: SmartTurn | None, fusion: Fusion | None = None, learned: TurnEndFusion | None = None
    ) -> None:
        self.audio_model = audio_model
        self.fusion = fusion or Fusion()
        self.learned = learned
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="turn-score")

    async def audio_score(self, audio: np.ndarray) -> float | None:
        if self.audio_model is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.audio_model.probability, audio)

    def fuse(self, audio_score: float | None, text: str) -> float | None:
        return self.fusion.score(audio_score, text_completeness(text))

    def with_language_model(self, transcript: Transcript, probability: float, audio_score: float | None) -> float:
        """The completeness of a pause a language model scored `probability` (common scale), from that score alone or,
        with a learned fusion, fused with the draft's confidence and the audio model's score (when it is in)."""
        learned = self.learned
        if learned is None:
            return lm_completeness(probability)
        values = features_of(transcript, learned.text_scorer, probability, audio_score)
        if not set(learned.features) <= values.keys():  # a signal the fusion weighs is not in: the score alone
            return lm_completeness(probability)
        return learned.completeness(learned.logit(values))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
