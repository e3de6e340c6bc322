"""The one pacer of reply audio: the session queues a reply's frames here, the transport plays them out in real time.

`run` sends each frame when it falls due, a short lead ahead of real time (WebSocket, gRPC); a transport with a
media clock of its own takes one frame per tick instead (the WebRTC track). `pause` holds the rest, `flush` drops it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from voicemesh.audio import FRAME_MS
from voicemesh.clients import epoch_us

log = logging.getLogger(__name__)

FRAME_S = FRAME_MS / 1000
LEAD_FRAMES = 5  # sent ahead of real time so the listener's jitter buffer starts filled (100 ms)

FrameT = TypeVar("FrameT")


class Playout(Generic[FrameT]):
    """Reply frames on their way out, at real-time pace.

    The first frame of a reply, and the `lead_frames` after it, leave at once; then one per `frame_s`. The same
    lead is sent again after a pause, a flush, or a consumer that fell behind by more than the lead (it never
    bursts more). Each frame that leaves goes to `on_played` with its send time in epoch microseconds, in order,
    so the session knows what was heard. Frames leave only through `run` or `take`, so a `pause` or a `flush`
    takes effect before the next frame: within one frame.

    A frame pushed after the listener's lead ran out (the reply's next audio came late) leaves a gap in what is
    heard; `gap_s` sums those gaps since the last `flush` (which ends a reply). `ahead_min_s` is the least audio
    the listener still had when more of the reply began to arrive (`push(..., more=True)`): how far ahead of
    playout the reply's later work ran, at its tightest (negative: behind, a gap).
    """

    def __init__(
        self,
        on_played: Callable[[FrameT, int], None],
        frame_s: float = FRAME_S,
        lead_frames: int = LEAD_FRAMES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_played = on_played
        self._frame_s = frame_s
        self._lead_s = lead_frames * frame_s
        self._clock = clock
        self._frames: collections.deque[FrameT] = collections.deque()
        self._next_due_s: float | None = None  # on `clock`; None: the next frame starts a lead
        self._paused = False
        self._changed = asyncio.Event()
        self.gap_s = 0.0
        self.ahead_min_s: float | None = None

    @property
    def queued(self) -> int:
        """Frames not played yet (held ones included)."""
        return len(self._frames)

    @property
    def paused(self) -> bool:
        return self._paused

    def push(self, frame: FrameT, more: bool = False) -> None:
        """Queue a frame; `more`: it begins more audio of the reply playing (its next chunk of speech)."""
        if more and (ahead_s := self.ahead_s()) is not None:
            self.ahead_min_s = ahead_s if self.ahead_min_s is None else min(self.ahead_min_s, ahead_s)
        self._frames.append(frame)
        self._changed.set()

    def ahead_s(self) -> float | None:
        """The audio the listener has yet to hear (negative: how long it has been dry); None while nothing plays
        (no reply started, or paused)."""
        if self._next_due_s is None or self._paused:
            return None
        # The listener plays a frame `lead` after it is due to leave, then what is queued.
        return self._next_due_s + self._lead_s + len(self._frames) * self._frame_s - self._clock()

    def pause(self) -> None:
        """Hold the queued frames; `resume` plays them on from the first one held."""
        self._paused = True
        self._next_due_s = None  # the listener's buffer runs dry during the pause: lead again on resume
        self._changed.set()

    def resume(self) -> None:
        self._paused = False
        self._changed.set()

    def flush(self) -> int:
        """Drop every queued frame and end a pause: the reply is over (barge-in, failure, close). Returns how many."""
        dropped = len(self._frames)
        self._frames.clear()
        self._paused = False
        self._next_due_s = None  # the next reply starts with a fresh lead
        self.gap_s = 0.0
        self.ahead_min_s = None
        self._changed.set()
        return dropped

    def retract(self, unfinished: Callable[[FrameT], bool]) -> int:
        """Take back the frames at the end of the queue for which `unfinished` holds (a chunk of speech whose
        synthesis broke off, to be synthesized again whole); returns how many. Frames already sent stay sent."""
        count = 0
        while self._frames and unfinished(self._frames[-1]):
            self._frames.pop()
            count += 1
        return count

    def wait_s(self) -> float | None:
        """Seconds until the next frame is due (0: now); None while there is nothing to play (empty or paused)."""
        if self._paused or not self._frames:
            return None
        now = self._clock()
        earliest = now - self._lead_s
        if self._next_due_s is None:
            self._next_due_s = earliest
        elif self._next_due_s < earliest:  # the listener has played all it had (its lead too) for this long
            self.gap_s += earliest - self._next_due_s
            self._next_due_s = earliest
        return max(0.0, self._next_due_s - now)

    def take(self) -> FrameT | None:
        """The next frame if it is due, reported as played; None otherwise. For a consumer with its own clock."""
        frame = self._pop_due()
        if frame is not None:
            self._on_played(frame, epoch_us())
        return frame

    async def run(self, send: Callable[[FrameT, int], Awaitable[None]]) -> None:
        """Send each frame as it falls due, `send(frame, sent_us)` then `on_played`, until cancelled."""
        while True:
            frame = self._pop_due()
            if frame is None:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self.wait_s())
                continue
            sent_us = epoch_us()
            await send(frame, sent_us)
            self._on_played(frame, sent_us)

    def start(self, send: Callable[[FrameT, int], Awaitable[None]]) -> asyncio.Task[None]:
        """`run` as a task; a failure is logged (the reply's audio stops), never silent. Cancel it to stop."""
        task = asyncio.ensure_future(self.run(send))
        task.add_done_callback(_log_failure)
        return task

    def _pop_due(self) -> FrameT | None:
        wait_s = self.wait_s()
        if wait_s is None or wait_s > 0:
            return None
        assert self._next_due_s is not None  # wait_s set it
        self._next_due_s += self._frame_s
        return self._frames.popleft()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("reply playout failed", exc_info=task.exception())
