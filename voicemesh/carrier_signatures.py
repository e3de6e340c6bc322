"""How phone carriers sign their webhooks, for the gateway that checks them and the test carrier that signs them:
Twilio's X-Twilio-Signature and the message Telnyx signs with Ed25519."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping, Sequence


def twilio_signature(auth_token: str, url: str, params: Mapping[str, Sequence[str]]) -> str:
    """Twilio's signature of a request: the URL, then each parameter's name and value, names sorted (a repeated
    name's values sorted too), HMAC-SHA1 with the auth token, base64."""
    data = url + "".join(name + value for name in sorted(params) for value in sorted(set(params[name])))
    return base64.b64encode(hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()).decode()


def telnyx_signed_message(timestamp: str, body: bytes) -> bytes:
    """What Telnyx signs with its Ed25519 key: the telnyx-timestamp header, a bar, the raw body."""
    return timestamp.encode() + b"|" + body
