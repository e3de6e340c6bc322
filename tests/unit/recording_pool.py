"""A worker pool that notes the priority of each job it runs (the TTS's and the ASR's scheduling tests)."""

from __future__ import annotations

from voicemesh.workers import WorkerPool


class RecordingPool(WorkerPool):
    """The real pool of one worker, noting each job's priority."""

    def __init__(self) -> None:
        super().__init__(1, "test-pool")
        self.priorities: list[int] = []

    async def run(self, fn, *args, priority: int = 0):  # type: ignore[no-untyped-def]
        self.priorities.append(priority)
        return await super().run(fn, *args, priority=priority)
