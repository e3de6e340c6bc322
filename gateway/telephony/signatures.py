"""Proof that a webhook came from the carrier: Twilio's X-Twilio-Signature (HMAC-SHA1 of the URL and the form
parameters, keyed by the account's auth token) and Telnyx's Ed25519 signature of `timestamp|body`."""

from __future__ import annotations

import base64
import binascii
import hmac
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

import grpc
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from voicemesh.carrier_signatures import telnyx_signed_message, twilio_signature
from voicemesh.errors import RequestError

__all__ = ["forbidden", "telnyx_public_key", "twilio_signature", "verify_telnyx", "verify_twilio"]

TELNYX_TOLERANCE_S = 300.0  # a signed webhook older (or newer) than this is a replay, not a call


def forbidden(reason: str) -> RequestError:
    """A webhook that failed verification (HTTP 403, no session)."""
    return RequestError(grpc.StatusCode.PERMISSION_DENIED, reason)


def _url_variants(url: str) -> set[str]:
    """The URL as Twilio may have signed it: with the scheme's default port written out and without any port."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    bare = host.rsplit(":", 1)[0] if parts.port is not None else host
    default_port = 443 if parts.scheme == "https" else 80
    with_port = host if parts.port is not None else f"{host}:{default_port}"
    return {urlunsplit(parts._replace(netloc=netloc)) for netloc in (bare, with_port)}


def verify_twilio(auth_token: str, url: str, params: Mapping[str, Sequence[str]], signature: str) -> None:
    """Raises PERMISSION_DENIED unless `signature` is Twilio's for this URL and these form parameters."""
    if not signature:
        raise forbidden("no X-Twilio-Signature header")
    for candidate in _url_variants(url):
        if hmac.compare_digest(twilio_signature(auth_token, candidate, params).encode(), signature.encode()):
            return
    raise forbidden(f"X-Twilio-Signature does not match {url} and its parameters")


def telnyx_public_key(encoded: str) -> Ed25519PublicKey:
    """The account's public key as the Telnyx portal shows it (base64 of the 32 raw bytes)."""
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(encoded, validate=True))
    except (ValueError, binascii.Error) as error:
        raise ValueError(f"telnyx_public_key is not a base64 Ed25519 public key (32 bytes): {error}") from error


def verify_telnyx(
    key: Ed25519PublicKey, timestamp: str, body: bytes, signature: str, now_s: float | None = None
) -> None:
    """Raises PERMISSION_DENIED unless `signature` (base64) signs `timestamp|body` with the account's key, within
    TELNYX_TOLERANCE_S of now."""
    if not (timestamp and signature):
        raise forbidden("no telnyx-signature-ed25519 or telnyx-timestamp header")
    try:
        skew_s = abs((time.time() if now_s is None else now_s) - int(timestamp))
    except ValueError:
        raise forbidden(f"telnyx-timestamp {timestamp[:32]!r} is not epoch seconds") from None
    if skew_s > TELNYX_TOLERANCE_S:
        raise forbidden(f"telnyx-timestamp is {skew_s:.0f} s from now (more than {TELNYX_TOLERANCE_S:g} s)")
    try:
        key.verify(base64.b64decode(signature, validate=True), telnyx_signed_message(timestamp, body))
    except (InvalidSignature, binascii.Error, ValueError):
        raise forbidden("telnyx-signature-ed25519 does not sign this request") from None
