"""Streaming Silero VAD: the v6 ONNX model shipped inside faster-whisper, fed one 512-sample window at a time."""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np
import onnxruntime
from faster_whisper.utils import get_assets_path

SAMPLE_RATE_HZ = 16000  # Silero's rate; the recognition stream runs at it
WINDOW_SAMPLES = 512  # 32 ms at 16 kHz: the model's window
CONTEXT_SAMPLES = 64  # the model sees the tail of the previous window before each window
WINDOW_MS = WINDOW_SAMPLES * 1000 // SAMPLE_RATE_HZ


def load_session() -> onnxruntime.InferenceSession:
    """One ONNX session for all streams (each stream keeps its own recurrent state)."""
    options = onnxruntime.SessionOptions()
    # One thread: a window takes ~0.2 ms; more threads only add wake-up cost and steal cores from Whisper.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    path = os.path.join(get_assets_path(), "silero_vad_v6.onnx")
    return onnxruntime.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])


class Vad(Protocol):
    """Speech probability of each 32 ms window of one stream, in order."""

    def probability(self, window: np.ndarray) -> float: ...


class StreamingVad:
    """Speech probability per 32 ms window of one stream, keeping the model's LSTM state between windows."""

    def __init__(self, session: onnxruntime.InferenceSession) -> None:
        self._session = session
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._context = np.zeros(CONTEXT_SAMPLES, dtype=np.float32)

    def probability(self, window: np.ndarray) -> float:
        """Speech probability of one window of exactly 512 float32 samples at 16 kHz."""
        if window.shape != (WINDOW_SAMPLES,):
            raise ValueError(f"VAD window must be {WINDOW_SAMPLES} samples, got {window.shape}")
        batch = np.concatenate([self._context, window]).astype(np.float32)[None, :]
        output, self._h, self._c = self._session.run(None, {"input": batch, "h": self._h, "c": self._c})
        self._context = window[-CONTEXT_SAMPLES:].astype(np.float32)
        return float(np.asarray(output).reshape(-1)[0])
