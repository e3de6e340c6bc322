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
    remembered_sessions: int = config.setting(10_000, "histories kept for reconnects (least recently used go first)")
    history_max_chars: int = config.setting(
        3000,
        "dialogue kept per session, in characters (~750 tokens: with a 2000-character system prompt and the reply "
        "it fits the embedded model's 2048-token context); past it the oldest half goes",
    )
    history_max_tokens: int = config.setting(
        1280,
        "dialogue kept per session, in tokens as the LLM counted the last turn's prompt and reply; past it the oldest "
        "half goes (with the next question and a reply of up to 512 tokens it fits the embedded model's 2048)",
    )
    http_port: int = config.setting(
        8080, "HTTP port of the browser doors (page, /api/offer, /api/ws); -1 = off; with --port 0 it is 0 too"
    )
    ice_servers: str = config.setting(
        "[]", 'STUN servers for WebRTC as JSON: [{"urls": "stun:host:3478"}] (TURN: turn_secret and turn_urls)'
    )
    ice_host_addresses: str = config.setting(
        "", "comma-separated ICE host candidate addresses; empty = 127.0.0.1 when host is loopback, else all interfaces"
    )
    allowed_origins: str = config.setting(
        "", "comma-separated page origins allowed besides the gateway's own (e.g. https://app.example.com; * = any)"
    )
    idle_timeout_s: float = config.setting(60.0, "a browser session that sends no audio this long is closed")
    max_session_s: float = config.setting(
        3600.0,
        "longest a session lasts; then (once the reply being spoken has played, at most drain_grace_s more) it ends "
        "with DEADLINE_EXCEEDED and the client starts a new one, which may resume the conversation; 0 = unbounded",
    )
    max_audio_ahead_ms: float = config.setting(
        2000.0,
        "audio may arrive this far ahead of real time (a client catching up); more is RESOURCE_EXHAUSTED, so a "
        "flood cannot queue minutes of audio in the gateway; 0 = no limit",
    )
    session_starts_per_minute: float = config.setting(
        600.0,
        "sessions (and WebRTC offers) one client may start per minute, by token subject or IP, in bursts of 10 s "
        "worth (a load test's ramp fits; a flood of new ids does not); 0 = no limit",
    )
    service_token: str = config.setting("", "bearer token sent to the ASR, LLM and TTS services (their auth_token)")
    service_tls_ca: str = config.setting("", "PEM CA the services' certificates are checked against: TLS to them")
    service_tls_cert: str = config.setting("", "PEM client certificate the gateway shows the services (mutual TLS)")
    service_tls_key: str = config.setting("", "the key of service_tls_cert")
    turn_secret: str = config.setting(
        "", "shared secret of a TURN server (coturn use-auth-secret): pages get credentials valid for turn_ttl_s"
    )
    turn_urls: str = config.setting("", "comma-separated turn:/turns: URLs the credentials are for")
    turn_ttl_s: float = config.setting(3600.0, "lifetime of the TURN credentials handed to an authenticated page")
    webrtc_connect_timeout_s: float = config.setting(3.0, "the page moves to WebSocket if WebRTC is not up by then")
    twilio_auth_token: str = config.setting(
        "", "Twilio account auth token: opens the Twilio phone door, whose webhooks are verified with it; empty = off"
    )
    telnyx_public_key: str = config.setting(
        "", "Telnyx account public key (base64 Ed25519): opens the Telnyx phone door, webhooks verified with it"
    )
    telephony_public_url: str = config.setting(
        "",
        "https URL the carriers reach this gateway at (a proxy in front): webhooks are verified against it and "
        "streams pointed at it; empty = the request's own",
    )
    telephony_stream_secret: str = config.setting(
        "",
        "key of the one-use stream tokens a webhook answer hands the carrier; the same on every replica behind one "
        "address; empty = random per process",
    )
    telephony_token_ttl_s: float = config.setting(30.0, "a phone stream must start this soon after its webhook")
    telephony_config: str = config.setting(
        "{}", "SessionConfig as JSON for phone calls (system prompt, voice, pipeline options); rates are the phone's"
    )
