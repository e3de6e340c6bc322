"""The unheard recordings: read speech from public repositories that nothing in this project was tuned on, written
as 16 kHz mono WAV for `python -m bench.turns --clip-dir DIR` and `python -m bench.turn_fusion --recordings DIR`.

Nothing is downloaded and nothing is committed: give it clones of the repositories below (`--repo OWNER/NAME=PATH`,
a plain or bare clone holding the pinned commit), and it reads each file at that commit. Recordings that stop
mid-sentence (the file was cut while the speaker talked) are left out unless `--all`: a long wait after them is
right, not dead air. SOURCES.md beside the WAVs says where each came from, at which commit, under which license.
`--librispeech fit|check` writes instead the LibriSpeech excerpts of Resemblyzer's repository, many voices for
`python -m bench.turn_fusion --read-speech`.

    python -m bench.unheard --repo speechbrain/speechbrain=~/src/speechbrain \\
        --repo CorentinJ/Real-Time-Voice-Cloning=~/src/rtvc --repo Picovoice/cheetah=~/src/cheetah --out /tmp/unheard
"""

from __future__ import annotations

import argparse
import io
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from faster_whisper import decode_audio

from bench import print_result
from voicemesh.audio import float_to_pcm16, write_wav

RATE_HZ = 16000


@dataclass(frozen=True)
class Recording:
    name: str  # the WAV's name in the set
    repo: str  # owner/name on GitHub
    commit: str
    path: str  # inside the repository
    license: str
    finished: bool = True  # False: the file stops mid-sentence


SPEECHBRAIN = ("speechbrain/speechbrain", "9c826ef3937bac885c8a6ca86c6889a30f256fb5")
RTVC = ("CorentinJ/Real-Time-Voice-Cloning", "865eba8826bb6d76721a9d828a546724779c23ab")
CHEETAH = ("Picovoice/cheetah", "83c2b51ae8648d21bb3abdb7fa18045a6bf1216d")
RESEMBLYZER = ("resemble-ai/Resemblyzer", "15d828edebe06bc72b9cabc8ef8ca5ab2cb457ce")
LIBRISPEECH = {"fit": "audio_data/librispeech_train-clean-100", "check": "audio_data/librispeech_test-other"}
"""LibriSpeech excerpts (CC BY 4.0) kept in Resemblyzer's repository: one utterance of each of 251 train-clean-100
speakers (`fit`) and 10 utterances of each of 10 test-other speakers (`check`), so no speaker is in both."""
RECORDINGS = (
    *(
        Recording(f"spk{speaker}_snt{n}", *SPEECHBRAIN, f"tests/samples/ASR/spk{speaker}_snt{n}.wav", "Apache-2.0")
        for speaker in (1, 2)
        for n in range(2, 7)  # snt1 of both speakers is in ../shared/audio
    ),
    *(
        Recording(f"example{n}", *SPEECHBRAIN, f"tests/samples/single-mic/example{n}.wav", "Apache-2.0")
        for n in (1, 5, 6)
    ),
    # "...review of activities thereunder. In this regard," and the file ends.
    Recording("LJ050-0131", *SPEECHBRAIN, "tests/samples/TTS/LJ050-0131.wav", "Apache-2.0", finished=False),
    Recording("6829_00000", *RTVC, "samples/6829_00000.mp3", "CC BY 4.0 (LibriSpeech)"),
    Recording("8230_00000", *RTVC, "samples/8230_00000.mp3", "CC BY 4.0 (LibriSpeech)"),
    # "...from Earth to their home in" and the file ends.
    Recording("p240_00000", *RTVC, "samples/p240_00000.mp3", "CC BY 4.0 (VCTK)", finished=False),
    Recording("cheetah_en", *CHEETAH, "resources/audio_samples/test_en.wav", "Apache-2.0"),
)


def _git(clone: Path, *args: str, missing: str) -> bytes:
    """A git command's output in the clone at `clone` (plain or bare); SystemExit saying what is `missing`."""
    try:
        return subprocess.run(["git", "-C", str(clone), *args], check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"{clone}: no {missing} ({error.stderr.decode().strip()})") from error


def read_at_commit(clone: Path, commit: str, path: str) -> bytes:
    """A file's bytes at `commit` of the clone at `clone`."""
    return _git(clone, "show", f"{commit}:{path}", missing=f"{path} at {commit[:12]}")


def recordings_under(clone: Path, repo: str, commit: str, folder: str, license: str) -> list[Recording]:
    """Every audio file (FLAC, WAV, MP3) under `folder` at `commit`, named by its file name. Whether each ends a
    sentence is not known here (`finished` stays True): `python -m bench.turn_fusion --read-speech` reads it off the
    transcript."""
    listing = _git(clone, "ls-tree", "-r", "--name-only", commit, folder, missing=f"commit {commit[:12]}")
    return [
        Recording(Path(path).stem, repo, commit, path, license)
        for path in listing.decode().splitlines()
        if path.lower().endswith((".flac", ".wav", ".mp3"))
    ]


def export(
    recordings: Sequence[Recording], clones: Mapping[str, Path], out: Path, every: bool = False
) -> list[Recording]:
    """Write each recording (the finished ones, unless `every`) to `out/NAME.wav` at 16 kHz mono, and SOURCES.md."""
    missing = sorted({r.repo for r in recordings} - set(clones))
    if missing:
        raise SystemExit(f"no clone given for {', '.join(missing)}: --repo OWNER/NAME=PATH")
    out.mkdir(parents=True, exist_ok=True)
    written = [r for r in recordings if every or r.finished]
    for recording in written:
        data = read_at_commit(clones[recording.repo], recording.commit, recording.path)
        samples = decode_audio(io.BytesIO(data), sampling_rate=RATE_HZ)
        write_wav(out / f"{recording.name}.wav", float_to_pcm16(samples), RATE_HZ)
    lines = [
        "# Unheard recordings (written by `python -m bench.unheard`; not part of voicemesh)",
        "",
        "| recording | repository | commit | path | license | finished |",
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r.name} | github.com/{r.repo} | `{r.commit}` | `{r.path}` | {r.license} | {'yes' if r.finished else 'no'} |"
            for r in written
        ),
    ]
    (out / "SOURCES.md").write_text("\n".join(lines) + "\n")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", action="append", default=[], help="OWNER/NAME=PATH of a clone (repeat)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the WAVs and SOURCES.md")
    parser.add_argument("--all", action="store_true", help="also the recordings that stop mid-sentence")
    parser.add_argument(
        "--librispeech",
        choices=sorted(LIBRISPEECH),
        help=f"instead, the LibriSpeech utterances of {RESEMBLYZER[0]} (fit: train-clean-100, check: test-other)",
    )
    args = parser.parse_args()
    clones: dict[str, Path] = {}
    for given in args.repo:
        repo, sep, path = given.partition("=")
        if not sep or not path:
            parser.error(f"--repo {given!r}: use OWNER/NAME=PATH")
        clones[repo] = Path(path).expanduser()
    if args.librispeech:
        if RESEMBLYZER[0] not in clones:
            parser.error(f"--librispeech needs --repo {RESEMBLYZER[0]}=PATH")
        clone = clones[RESEMBLYZER[0]]
        recordings = recordings_under(clone, *RESEMBLYZER, LIBRISPEECH[args.librispeech], "CC BY 4.0 (LibriSpeech)")
    else:
        recordings = list(RECORDINGS)
    written = export(recordings, clones, args.out, args.all)
    print_result({"out": str(args.out), "recordings": [r.name for r in written]})


if __name__ == "__main__":
    main()
