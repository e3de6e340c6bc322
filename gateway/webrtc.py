"""The WebRTC door's media side (aiortc): one peer connection per browser session.

The page's microphone arrives as an Opus track, decoded to 48 kHz and cut into 20 ms PCM16 frames for the session;
reply audio goes back on an Opus track whose media clock takes the session's playout one frame per tick (silence
when there is none); events go to the page as JSON on the "events" RTCDataChannel the page opens, and the page
sends its control messages ({"type": "stop"}, {"type": "report", ...}) there too, as on the WebSocket.
Signalling (POST /api/offer) is in gateway/web.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fractions
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aioice.ice
import av
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpReceiver,
    RTCSessionDescription,
)
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from gateway.browser import BrowserSession
from gateway.playout import Playout
from gateway.session import ReplyFrame
from gateway.settings import GatewaySettings
from voicemesh.audio import Framer, samples_per_frame
from voicemesh.clients import epoch_us
from voicemesh.errors import RequestError

log = logging.getLogger(__name__)

INPUT_RATE_HZ = 48000  # Opus decodes at 48 kHz: the session takes the mic at that rate, no resampling here
EVENTS_CHANNEL = "events"
MAX_PENDING_EVENTS = 1000  # events held until the data channel opens; more: the page is not reading
MAX_BUFFERED_BYTES = 256 * 1024  # events queued in the data channel, unsent (the SCTP window is full); more: likewise
ICE_SCHEMES = ("stun:", "turn:", "turns:")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
ANY_HOSTS = ("0.0.0.0", "::", "")


@dataclasses.dataclass(frozen=True)
class WebRtcOptions:
    """The WebRTC settings of a gateway, parsed once."""

    ice_servers: list[RTCIceServer]
    page_ice_servers: list[dict[str, Any]]
    """The same servers in the page's RTCConfiguration form."""
    host_addresses: list[str] | None
    """ICE host candidates the gateway offers; None = aioice's choice (every interface but loopback)."""

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> WebRtcOptions:
        servers = parse_ice_servers(settings.ice_servers)
        addresses: list[str] | None
        if settings.ice_host_addresses.strip():
            addresses = [a.strip() for a in settings.ice_host_addresses.split(",") if a.strip()]
        elif settings.host in ANY_HOSTS:
            addresses = None
        elif settings.host in LOOPBACK_HOSTS:
            addresses = ["127.0.0.1"]
        else:
            addresses = [settings.host]
        return cls(
            ice_servers=[RTCIceServer(**server) for server in servers],
            page_ice_servers=servers,
            host_addresses=addresses,
        )

    def install(self) -> None:
        """Offer `host_addresses` as ICE host candidates.

        aioice leaves loopback out, so a gateway bound to 127.0.0.1 (the local default, and the only address in a
        loopback-only test network) would offer the browser nothing to connect to. aioice has no option for it,
        so its address discovery is replaced for this process (one gateway per process).
        """
        if self.host_addresses is not None:
            addresses = list(self.host_addresses)
            aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: list(addresses)


def parse_ice_servers(raw: str) -> list[dict[str, Any]]:
    """The ice_servers setting (JSON list of {urls, username?, credential?}); SystemExit naming the problem."""
    try:
        servers = json.loads(raw or "[]")
    except ValueError as error:
        raise SystemExit(f'setting ice_servers: not JSON ({error}); e.g. [{{"urls": "stun:host:3478"}}]') from error
    if not isinstance(servers, list):
        raise SystemExit("setting ice_servers: expected a JSON list of {urls, username, credential}")
    parsed = []
    for index, server in enumerate(servers):
        if not isinstance(server, dict) or "urls" not in server:
            # The entry itself is not echoed: it may hold a credential.
            raise SystemExit(f"setting ice_servers: entry {index} has no 'urls'")
        urls = server["urls"] if isinstance(server["urls"], list) else [server["urls"]]
        for url in urls:
            if not isinstance(url, str) or not url.startswith(ICE_SCHEMES):
                raise SystemExit(f"setting ice_servers: {url!r} is not a stun:, turn: or turns: URL")
            if url.startswith(("turn:", "turns:")) and not (server.get("username") and server.get("credential")):
                raise SystemExit(f"setting ice_servers: TURN server {url} needs a username and a credential")
        entry: dict[str, Any] = {"urls": urls}
        for key in ("username", "credential"):
            if server.get(key):
                entry[key] = str(server[key])
        parsed.append(entry)
    return parsed


class ReplyTrack(MediaStreamTrack):
    """The reply as an audio track: each 20 ms tick of its media clock takes the playout's next frame, or silence.

    RTP goes out at real time and the browser's jitter buffer does the rest, so the track sends no lead.
    """

    kind = "audio"

    def __init__(self, playout: Playout[ReplyFrame], rate_hz: int) -> None:
        super().__init__()
        self.playout = playout
        self.rate_hz = rate_hz
        self._samples = samples_per_frame(rate_hz)
        self._frame_bytes = self._samples * 2
        self._start_s: float | None = None
        self._pts = 0

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start_s is None:
            self._start_s = time.monotonic()
        else:
            self._pts += self._samples
            delay = self._start_s + self._pts / self.rate_hz - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        reply = self.playout.take()
        pcm16 = reply.speech.frame.data[: self._frame_bytes] if reply is not None else b""
        frame = av.AudioFrame(format="s16", layout="mono", samples=self._samples)
        frame.planes[0].update(pcm16 + b"\x00" * (self._frame_bytes - len(pcm16)))
        frame.pts = self._pts
        frame.sample_rate = self.rate_hz
        frame.time_base = fractions.Fraction(1, self.rate_hz)
        return frame


GIVE_UP_AFTER_PACKETS = 2  # a microphone packet still missing while this many later ones wait is lost (40 ms)


class PacketPerFrameBuffer(JitterBuffer):
    """The microphone's RTP, handed to the decoder packet by packet, in order, as soon as each is next.

    aiortc's JitterBuffer finds the end of a frame by the arrival of a packet with the next timestamp (a video frame
    spans packets), so every audio packet waited for the next one: 20 ms of uplink on every turn, even with no
    prefetch. An Opus packet is a whole frame, so the next one in order goes on the moment it is here. A packet that is
    still missing while GIVE_UP_AFTER_PACKETS later ones wait is given up on: the ASR hears 20 ms less instead of the
    buffer holding everything behind the gap until it overflows. (aiortc's buffer hands on one frame per packet that
    arrives, so a backlog never drains: one lost packet left the audio behind for the rest of the call;
    docs/decisions/0029.)
    """

    def _remove_frame(self, sequence_number: int) -> JitterFrame | None:
        if self._origin is None:
            return None
        if self._packets[self._origin % self._capacity] is None:
            if sum(packet is not None for packet in self._packets) < GIVE_UP_AFTER_PACKETS:
                return None
            while self._packets[self._origin % self._capacity] is None:
                self.remove(1)
        packet = self._packets[self._origin % self._capacity]
        assert packet is not None  # the loop above stops at one
        self.remove(1)
        return JitterFrame(data=packet._data, timestamp=packet.timestamp)  # type: ignore[attr-defined]


def hand_packets_on_at_once(receiver: RTCRtpReceiver) -> None:
    """The microphone's packets go to the decoder as each arrives (PacketPerFrameBuffer), not four packets later.

    aiortc's audio receiver holds 4 complete frames in its jitter buffer before it decodes the oldest (prefetch=4),
    which is for a listener: smooth playout, and each frame is complete only once the next packet is here. The session
    only reads the audio (its ASR takes frames as they come and has no clock to keep), so the prefetch was only delay
    on every turn's uplink. aiortc keeps the buffer private (1.16.0, pinned in pyproject.toml); where a later release
    renames it, the default stays and a warning says so.
    """
    attribute = "_RTCRtpReceiver__jitter_buffer"
    if not isinstance(getattr(receiver, attribute, None), JitterBuffer):
        log.warning("aiortc's receive jitter buffer was not found: the microphone keeps its 80 ms prefetch")
        return
    setattr(receiver, attribute, PacketPerFrameBuffer(capacity=16))


class WebRtcPeer:
    """One browser's peer connection, as the Transport of its BrowserSession."""

    def __init__(self, options: WebRtcOptions, browser: BrowserSession) -> None:
        self.browser = browser
        self.session_id = browser.session_id
        # Always a list: given None, aiortc falls back to a public STUN server, which a gateway must not call
        # unless its operator configured it.
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=list(options.ice_servers)))
        self.reply = ReplyTrack(browser.session.playout, browser.session.options.output_rate_hz)
        self._channel: RTCDataChannel | None = None
        self._pending: list[str] = []
        self._ended = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.pc.on("track", self._on_track)
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("iceconnectionstatechange", self._on_ice_state)
        self.pc.on("connectionstatechange", self._on_connection_state)

    async def answer(self, offer_sdp: str) -> RTCSessionDescription:
        """Answer the page's offer; all candidates are gathered before returning (no trickle ICE)."""
        if "m=audio" not in offer_sdp:
            raise ValueError("the offer has no audio: add the microphone track before creating it")
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
            for transceiver in self.pc.getTransceivers():
                if transceiver.kind == "audio":
                    hand_packets_on_at_once(transceiver.receiver)
            # After the remote description, so the reply rides on the page's (sendrecv) audio transceiver.
            self.pc.addTrack(self.reply)
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except (ValueError, KeyError, IndexError, AttributeError, TypeError, AssertionError) as error:
            # aiortc's SDP parser asserts on a line it cannot read (found by bench/chaos/fuzz.py: a 500 otherwise).
            raise ValueError(str(error) or f"a malformed line ({type(error).__name__})") from error
        return self.pc.localDescription

    async def input_ended(self) -> None:
        """Returns when the page's side is gone: the connection failed or closed, or the mic track ended."""
        await self._ended.wait()

    # ---- Transport ----------------------------------------------------------------------------------------------
    async def send_json(self, message: dict[str, Any]) -> None:
        """Onto the data channel, whose send never waits: its queue and the one before it opens are bounded here, so a
        page that is not reading (or a path that went dark) ends the session instead of growing them."""
        text = json.dumps(message)
        channel = self._channel
        if channel is None:
            if len(self._pending) < MAX_PENDING_EVENTS:
                self._pending.append(text)
            else:
                what = f"{MAX_PENDING_EVENTS} events wait for the page to open its {EVENTS_CHANNEL!r} data channel"
                self.browser.downlink.overflow(what)
        elif channel.readyState != "open":
            return  # the page is closing it
        elif channel.bufferedAmount > MAX_BUFFERED_BYTES:
            self.browser.downlink.overflow(f"{MAX_BUFFERED_BYTES // 1024} KiB of events wait on the data channel")
        elif self.pc.connectionState == "connected":  # not into a connection that is going down
            channel.send(text)

    async def close(self, code: int, reason: str) -> None:
        await self.send_json({"type": "closed", "code": code, "reason": reason})
        if self._channel is not None and self._channel.readyState == "open":
            for _ in range(25):  # SCTP sends asynchronously: give the last message a moment to leave
                if not self._channel.bufferedAmount:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
        try:
            await self.pc.close()
        except AttributeError as error:
            # aiortc cannot close a connection it half built from an offer it could not answer (a BUNDLE group naming
            # a section that is not there leaves its SCTP transport unset; found by bench/chaos/fuzz.py). Its answer
            # failed before any candidate was gathered, so no socket is left open.
            log.info("peer connection closed half built", extra={"session_id": self.session_id, "error": str(error)})
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- events -------------------------------------------------------------------------------------------------
    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self._spawn(self._read_mic(track))

    async def _read_mic(self, track: MediaStreamTrack) -> None:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=INPUT_RATE_HZ)
        framer = Framer(INPUT_RATE_HZ)
        try:
            while True:
                frame = await track.recv()
                if not isinstance(frame, av.AudioFrame):
                    continue
                for mono in resampler.resample(frame):
                    for pcm16 in framer.push(mono.to_ndarray().tobytes()):
                        # aiortc surfaces neither the browser's capture clock nor RTCP sender reports, so the
                        # gateway's receipt time stands in for the capture time: WebRTC turns report upload_ms = 0
                        # and the gateway's V2V starts at receipt (the page measures the whole of it).
                        self.browser.push_audio(pcm16, epoch_us())
        except MediaStreamError:
            log.info("microphone track ended", extra={"session_id": self.session_id})
        except RequestError as error:
            log.warning("microphone frame refused", extra={"session_id": self.session_id, "reason": error.message})
        self._ended.set()

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_CHANNEL:
            return
        self._channel = channel
        pending, self._pending = self._pending, []
        for text in pending:
            channel.send(text)
        channel.on("message", self._on_message)

    def _on_message(self, message: object) -> None:
        try:
            control = json.loads(message) if isinstance(message, str) else None
        except ValueError:
            control = None
        self._spawn(self.browser.control(control))

    def _on_ice_state(self) -> None:
        log.info(
            "ICE state", extra={"session_id": self.session_id, "side": "gateway", "state": self.pc.iceConnectionState}
        )

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        log.info("WebRTC connection state", extra={"session_id": self.session_id, "state": state})
        if state in ("failed", "closed"):
            self._ended.set()
