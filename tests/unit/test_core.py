import asyncio

import grpc
import numpy as np
import pytest

from voicemesh import config
from voicemesh.audio import Framer, StreamResampler, float_to_pcm16, pcm16_to_float
from voicemesh.errors import RequestError
from voicemesh.frames import FrameChecker
from voicemesh.v1 import audio_pb2
from voicemesh.workers import Newest, WorkerPool


def frame(seq: int, data: bytes = b"\x00\x00" * 320, rate: int = 16000, encoding: int = 1) -> audio_pb2.AudioFrame:
    return audio_pb2.AudioFrame(data=data, encoding=encoding, sample_rate_hz=rate, seq=seq)


@pytest.mark.parametrize(
    ("bad", "code", "words"),
    [
        (frame(0, encoding=0), grpc.StatusCode.INVALID_ARGUMENT, "AUDIO_ENCODING_PCM16LE"),
        (frame(0, rate=44100), grpc.StatusCode.INVALID_ARGUMENT, "sample_rate_hz=44100"),
        (frame(0, data=b"\x00" * 641), grpc.StatusCode.INVALID_ARGUMENT, "odd"),
        (frame(0, data=b""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (frame(0, data=b"\x00" * 64002), grpc.StatusCode.OUT_OF_RANGE, "1000 ms"),
    ],
)
def test_frame_checker_rejects_bad_frames(bad: audio_pb2.AudioFrame, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(RequestError) as error:
        FrameChecker(16000).check(bad)
    assert error.value.code == code and words in error.value.message


def test_frame_checker_seq_gap_and_repeat() -> None:
    checker = FrameChecker(16000)
    checker.check(frame(5))
    checker.check(frame(6))
    with pytest.raises(RequestError) as gap:
        checker.check(frame(9))
    assert gap.value.code == grpc.StatusCode.OUT_OF_RANGE and "2 frame(s) missing" in gap.value.message
    checker = FrameChecker(16000)
    checker.check(frame(1))
    with pytest.raises(RequestError) as repeat:
        checker.check(frame(1))
    assert repeat.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_pcm_roundtrip_and_framing() -> None:
    samples = np.linspace(-1, 0.99, 1000).astype(np.float32)
    assert np.allclose(pcm16_to_float(float_to_pcm16(samples)), samples, atol=1e-4)
    framer = Framer(16000)
    frames = list(framer.push(b"\x01\x00" * 700)) + list(framer.flush())
    assert [len(f) for f in frames] == [640, 640, 640]


def test_stream_resampler_keeps_length_over_chunks() -> None:
    resampler = StreamResampler(48000, 16000)
    out = [resampler.process(np.zeros(960, dtype=np.float32)) for _ in range(50)]
    out.append(resampler.process(np.zeros(0, dtype=np.float32), last=True))
    assert abs(sum(len(o) for o in out) - 16000) <= 2


def test_stream_resampler_hands_on_each_chunk_at_once_in_time_and_without_aliasing() -> None:
    """A 20 ms frame at 48 kHz comes out as (nearly) its 320 samples at 16 kHz at once: the ASR hears the end of
    speech when its frame arrives, not one or two frames later. Speech band passes; what would alias is gone."""
    resampler = StreamResampler(48000, 16000)
    impulse = np.zeros(48000, dtype=np.float32)
    impulse[4800] = 1.0  # at 100 ms
    out, held = [], []
    for start in range(0, len(impulse), 960):
        out.append(resampler.process(impulse[start : start + 960]))
        held.append((start + 960) // 3 - sum(len(o) for o in out))
    assert max(held) <= 32, f"held back up to {max(held) / 16:.1f} ms of the stream"
    assert int(np.argmax(np.abs(np.concatenate(out)))) == 1600, "the impulse stays at 100 ms"
    t = np.arange(48000) / 48000
    for hz, gain in ((1000, 1.0), (6000, 1.0), (10000, 0.0)):
        resampler = StreamResampler(48000, 16000)
        tone = (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
        y = np.concatenate([resampler.process(tone[i : i + 960]) for i in range(0, len(tone), 960)])[800:]
        assert np.sqrt(np.mean(y**2)) / (0.5 / np.sqrt(2)) == pytest.approx(gain, abs=0.05), hz


def test_settings_from_flags_env_and_defaults() -> None:
    from services.asr.server import AsrSettings

    built = config.build(
        AsrSettings, "asr", {"port": "7000"}, {"VOICEMESH_ASR_CPU_THREADS": "2", "VOICEMESH_ASR_PORT": "9"}
    )
    assert built.port == 7000 and built.cpu_threads == 2 and built.workers == 2
    with pytest.raises(SystemExit, match="VOICEMESH_ASR_WORKERS"):
        config.build(AsrSettings, "asr", {}, {"VOICEMESH_ASR_WORKERS": "many"})
    with pytest.raises(SystemExit, match=r"unknown setting.*VOICEMESH_ASR_LANGUAGE"):
        config.build(AsrSettings, "asr", {}, {"VOICEMESH_ASR_LANGUAGE": "en"})


async def test_worker_pool_runs_priority_first_and_measures_queue() -> None:
    pool = WorkerPool(1, "test")
    order: list[str] = []
    gate = asyncio.Event()

    async def hold() -> None:
        async with pool.slot():
            await gate.wait()

    holder = asyncio.ensure_future(hold())
    await asyncio.sleep(0)
    low = asyncio.ensure_future(pool.run(order.append, "partial", priority=10))
    high = asyncio.ensure_future(pool.run(order.append, "final", priority=0))
    await asyncio.sleep(0.01)
    assert pool.waiting == 2
    gate.set()
    await asyncio.gather(holder, low, high)
    assert order == ["final", "partial"]
    assert (await high).queue_ms >= 5
    pool.shutdown()


async def test_worker_pool_cancelled_waiter_does_not_leak_the_worker() -> None:
    pool = WorkerPool(1, "test")
    gate = asyncio.Event()

    async def hold() -> None:
        async with pool.slot():
            await gate.wait()

    holder = asyncio.ensure_future(hold())
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(pool.run(sum, [1, 2]))
    await asyncio.sleep(0.01)
    waiter.cancel()
    gate.set()
    await holder
    assert (await pool.run(sum, [1, 2])).result == 3
    assert pool.busy == 0
    pool.shutdown()


def test_audio_faster_than_real_time_is_refused_beyond_the_allowed_lead() -> None:
    now = [0.0]
    checker = FrameChecker(16000, max_ahead_ms=200, clock=lambda: now[0])
    frame = b"\x00\x00" * 320  # 20 ms
    for seq in range(10):  # 200 ms at once: as far ahead of the clock as allowed
        checker.check(audio_pb2.AudioFrame(data=frame, seq=seq, encoding=audio_pb2.AUDIO_ENCODING_PCM16LE))
    with pytest.raises(RequestError) as flood:
        checker.check(audio_pb2.AudioFrame(data=frame, seq=10, encoding=audio_pb2.AUDIO_ENCODING_PCM16LE))
    assert flood.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "faster than real time" in flood.value.message
    real_time = FrameChecker(16000, max_ahead_ms=200, clock=lambda: now[0])
    for seq in range(500):  # 10 s at real pace is fine
        now[0] = seq * 0.02
        real_time.check(audio_pb2.AudioFrame(data=frame, seq=seq, encoding=audio_pb2.AUDIO_ENCODING_PCM16LE))


async def test_newest_runs_one_call_at_a_time_and_only_the_newest_waiting_value() -> None:
    started: list[str] = []
    release = asyncio.Event()
    held = False

    async def work(value: str) -> None:
        started.append(value)
        await release.wait()

    newest = Newest(work, held=lambda: held)
    newest.offer("a")
    await asyncio.sleep(0)
    newest.offer("b")
    newest.offer("c")  # "b" was superseded while "a" ran
    release.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert started == ["a", "c"]
    held = True
    newest.offer("d")
    await asyncio.sleep(0)
    assert started == ["a", "c"], "nothing runs while held"
    held, release = False, asyncio.Event()
    newest.offer("e")
    await asyncio.sleep(0)
    await newest.close()  # cancels "e" mid-call
    assert started == ["a", "c", "e"]
