"""The caller's audio on its way in: media chunks put in order by their number, a chunk that never comes filled with
silence (and counted), then decoded from G.711 to the 8 kHz PCM16 the session's ASR stream takes."""

from __future__ import annotations

from collections.abc import Callable

from gateway.telephony.carrier import CODECS
from voicemesh.errors import invalid

REORDER_CHUNKS = 3  # a chunk missing while this many later ones wait is lost: 60 ms of 20 ms chunks
MAX_GAP_CHUNKS = 50  # a jump of more than 1 s of chunks is not a network's loss but a broken stream


class ChunkOrder:
    """Chunks in the carrier's numbering, out in order: at once while they come in order (no added delay), a late one
    awaited while fewer than REORDER_CHUNKS later ones wait, a lost one replaced by silence as long as the last."""

    def __init__(self, silence: bytes) -> None:
        self._silence = silence
        self._next: int | None = None
        self._waiting: dict[int, bytes] = {}
        self.filled = 0
        """Chunks never received, heard as silence."""
        self.late = 0
        """Chunks that came after their place was filled, or twice: dropped."""

    def push(self, number: int, data: bytes) -> list[bytes]:
        """The chunks now ready, in order; raises INVALID_ARGUMENT for a number far beyond the next."""
        if self._next is None:
            self._next = number
        if number < self._next or number in self._waiting:
            self.late += 1
            return []
        if number - self._next > MAX_GAP_CHUNKS:
            raise invalid(
                f"media chunk {number} came when chunk {self._next} was next: over {MAX_GAP_CHUNKS} chunks missing"
            )
        self._waiting[number] = data
        ready = []
        while self._waiting:
            chunk = self._waiting.pop(self._next, None)
            if chunk is None:
                if len(self._waiting) < REORDER_CHUNKS:
                    break
                chunk = self._silence[: len(self._waiting[min(self._waiting)])] or self._silence
                self.filled += 1
            ready.append(chunk)
            self._next += 1
        return ready


class CallerAudio:
    """One call's inbound track: `push` a media chunk, get the PCM16 to hear, in order, gaps filled."""

    def __init__(self, encoding: str) -> None:
        decode, encode = CODECS[encoding]
        self._decode: Callable[[bytes], bytes] = decode
        # A second of the codec's silence, cut to the size of the chunks around a gap.
        self.order = ChunkOrder(encode(bytes(2 * 8000)))

    def push(self, chunk: int, payload: bytes) -> list[bytes]:
        return [self._decode(data) for data in self.order.push(chunk, payload)]
