"""The speech a load test sends: WAV files as 20 ms frames at 16 kHz, cut shortly after their speech ends."""

from __future__ import annotations

import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from voicemesh.audio import FRAME_MS, read_wav
from voicemesh.conversation import speech_frames
from voicemesh.loadtest.options import LoadTestError

RATE_HZ = 16000
TAIL_FRAMES = 5  # keep 100 ms after a clip's last speech frame; the harness adds its own pauses


@dataclass(frozen=True)
class SpeechClip:
    """One clip as the 20 ms PCM16 frames at 16 kHz a session sends, and which of them hold speech."""

    name: str
    frames: tuple[bytes, ...]
    is_speech: tuple[bool, ...]

    @property
    def duration_s(self) -> float:
        return len(self.frames) * FRAME_MS / 1000


def load_clips(paths: Sequence[str | Path]) -> list[SpeechClip]:
    """Read WAV files (directories: every *.wav, sorted) as 16 kHz frames, trimming silence after the speech."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.glob("*.wav"))
            if not found:
                raise LoadTestError(f"{path}: a directory with no .wav files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise LoadTestError(f"{path}: no such file or directory")
    clips = []
    for path in files:
        try:
            audio = read_wav(path)
        except (ValueError, EOFError, wave.Error) as error:
            raise LoadTestError(f"{path}: not a readable 16-bit PCM WAV ({error})") from error
        frames = audio.to_rate(RATE_HZ).frames()
        speech = speech_frames(frames) if frames else []
        if not any(speech):
            raise LoadTestError(f"{path}: no speech in it (every frame is below the energy threshold)")
        # A long silent tail would let the gateway answer before the clip is over; the harness pauses itself.
        keep = max(index for index, is_speech in enumerate(speech) if is_speech) + 1 + TAIL_FRAMES
        clips.append(SpeechClip(path.stem, tuple(frames[:keep]), tuple(speech[:keep])))
    return clips
