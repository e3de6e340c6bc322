"""The gateway's settings (flags or VOICEMESH_GATEWAY_* env), read once in `main` and passed down."""

from __future__ import annotations

import dataclasses

from voicemesh import config


@dataclasses.dataclass(frozen=True)
class GatewaySettings(config.ServerSettings):
    """Settings of the gateway (flags or VOICEMESH_GATEWAY_* env)."""

    port: int = config.setting(50051, "gRPC Conversation port")
    asr_target: str = config.setting("127.0.0.1:50061", "ASR replicas: host:port[,host:port] or dns:///name:port")
    llm_target: str = config.setting(
        "127.0.0.1:50062", "LLM replicas (sessions stick by rendezvous hash): host:port[,...] or dns:///name:port"
    )
    tts_target: str = config.setting("127.0.0.1:50063", "TTS replicas: host:port[,host:port] or dns:///name:port")
    max_sessions: int = config.setting(64, "concurrent sessions; more are refused with RESOURCE_EXHAUSTED")
    auth_token: str = config.setting(
        "",
        "if set, clients must send `authorization: Bearer <token>` (gRPC metadata or HTTP header; the page "
        "passes it as ?token=); empty = no auth",
    )
    remembered_sessions: int = config.setting(10_000, "histories kept for reconnects (least recently used go first)")
    http_port: int = config.setting(
        8080, "HTTP port of the browser doors (page, /api/offer, /api/ws); -1 = off; with --port 0 it is 0 too"
    )
    ice_servers: str = config.setting(
        "[]", 'STUN/TURN servers for WebRTC as JSON: [{"urls": "turn:host:3478", "username": "u", "credential": "p"}]'
    )
    ice_host_addresses: str = config.setting(
        "", "comma-separated ICE host candidate addresses; empty = 127.0.0.1 when host is loopback, else all interfaces"
    )
    allowed_origins: str = config.setting(
        "", "comma-separated page origins allowed besides the gateway's own (e.g. https://app.example.com; * = any)"
    )
    idle_timeout_s: float = config.setting(60.0, "a browser session that sends no audio this long is closed")
    webrtc_connect_timeout_s: float = config.setting(3.0, "the page moves to WebSocket if WebRTC is not up by then")
