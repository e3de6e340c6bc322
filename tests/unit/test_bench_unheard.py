"""bench.unheard: recordings read from a clone at their pinned commit, written as 16 kHz WAV with their sources."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from bench.unheard import Recording, export, recordings_under
from voicemesh.audio import float_to_pcm16, read_wav, write_wav


def _git(repo: Path, *args: str) -> str:
    command = ["git", "-C", str(repo), "-c", "user.email=t@example.com", "-c", "user.name=t", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def test_the_finished_recordings_of_a_commit_are_written_at_16_khz_with_their_sources(tmp_path: Path) -> None:
    repo = tmp_path / "clone"
    repo.mkdir()
    _git(repo, "init", "-q")
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(8000) / 8000)).astype(np.float32)
    write_wav(repo / "said.wav", float_to_pcm16(tone), 8000)
    write_wav(repo / "cut.wav", float_to_pcm16(tone), 8000)
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "recordings")
    commit = _git(repo, "rev-parse", "HEAD")
    (repo / "said.wav").unlink()  # read at the commit, not from the work tree
    recordings = [
        Recording("said", "someone/speech", commit, "said.wav", "CC0"),
        Recording("cut", "someone/speech", commit, "cut.wav", "CC0", finished=False),
    ]
    out = tmp_path / "set"
    written = export(recordings, {"someone/speech": repo}, out)
    assert [r.name for r in written] == ["said"]
    clip = read_wav(out / "said.wav")
    assert clip.rate_hz == 16000 and abs(len(clip.samples) - 16000) < 200
    assert not (out / "cut.wav").exists(), "one that stops mid-sentence only with every=True"
    sources = (out / "SOURCES.md").read_text()
    assert commit in sources and "said.wav" in sources and "CC0" in sources
    assert [r.name for r in export(recordings, {"someone/speech": repo}, out, every=True)] == ["said", "cut"]


def test_a_recording_whose_clone_is_missing_or_lacks_it_is_refused_by_name(tmp_path: Path) -> None:
    recording = Recording("said", "someone/speech", "0" * 40, "said.wav", "CC0")
    with pytest.raises(SystemExit, match="no clone given for someone/speech"):
        export([recording], {}, tmp_path / "set")
    repo = tmp_path / "clone"
    repo.mkdir()
    _git(repo, "init", "-q")
    with pytest.raises(SystemExit, match=r"no said\.wav at 000000000000"):
        export([recording], {"someone/speech": repo}, tmp_path / "set")


def test_every_recording_under_a_folder_at_a_commit_is_listed_and_written(tmp_path: Path) -> None:
    repo = tmp_path / "clone"
    (repo / "speech" / "19").mkdir(parents=True)
    _git(repo, "init", "-q")
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000)).astype(np.float32)
    write_wav(repo / "speech" / "19" / "19-198-0001.wav", float_to_pcm16(tone), 16000)
    (repo / "speech" / "README.md").write_text("not audio")
    write_wav(repo / "elsewhere.wav", float_to_pcm16(tone), 16000)
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "speech")
    commit = _git(repo, "rev-parse", "HEAD")
    write_wav(repo / "speech" / "19" / "later.wav", float_to_pcm16(tone), 16000)  # not at the commit
    listed = recordings_under(repo, "someone/speech", commit, "speech", "CC BY 4.0")
    assert [(r.name, r.path) for r in listed] == [("19-198-0001", "speech/19/19-198-0001.wav")]
    assert [r.name for r in export(listed, {"someone/speech": repo}, tmp_path / "set")] == ["19-198-0001"]
