"""The short-lived token a webhook answer hands the carrier for its stream (a custom parameter of the stream, which
arrives in its `start`): only a call the carrier announced with a verified webhook can open a stream, once."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable

import grpc
import jwt

from voicemesh.errors import RequestError


def unauthenticated(reason: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAUTHENTICATED, reason)


class StreamTokens:
    """HS256 JWTs naming the carrier and the call, valid for `ttl_s` and for one stream each.

    With no `secret`, a random key per process: a stream then has to reach the replica that answered its webhook
    (set the same secret on every replica behind one address)."""

    def __init__(self, secret: str, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        # Hashed to the 32 bytes HS256 wants, however long the configured secret is.
        self._key = hashlib.sha256(secret.encode()).digest() if secret else secrets.token_bytes(32)
        self.ttl_s = ttl_s
        self._clock = clock
        self._used: dict[str, float] = {}  # token id -> its expiry, while it could still be replayed

    def issue(self, carrier: str, call_id: str) -> str:
        claims = {
            "sub": call_id,
            "aud": f"voicemesh-{carrier}-stream",
            "exp": self._clock() + self.ttl_s,
            "jti": secrets.token_urlsafe(12),
        }
        return jwt.encode(claims, self._key, algorithm="HS256")

    def redeem(self, token: str, carrier: str, call_id: str) -> None:
        """Accept the token once, for this carrier's stream of this call; raises UNAUTHENTICATED saying why not."""
        if not token:
            raise unauthenticated("the stream's start carries no token parameter")
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=["HS256"],
                audience=f"voicemesh-{carrier}-stream",
                options={"require": ["sub", "exp", "jti"], "verify_iat": False},
                leeway=0,
            )
        except jwt.ExpiredSignatureError:
            raise unauthenticated("the stream token has expired; the carrier opens the stream at once") from None
        except jwt.InvalidTokenError as error:
            raise unauthenticated(f"the stream token is not one this gateway issued: {error}") from None
        now_s = self._clock()
        if claims["sub"] != call_id:
            raise unauthenticated("the stream token was issued for another call")
        self._used = {jti: exp for jti, exp in self._used.items() if exp > now_s}
        if claims["jti"] in self._used:
            raise unauthenticated("the stream token was used already")
        self._used[claims["jti"]] = float(claims["exp"])
