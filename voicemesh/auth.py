"""Who may call: a static bearer token (the simple mode) or signed JWTs (HS256, several keys so that keys can
rotate) that carry a subject and an expiry; and short-lived TURN credentials in the TURN REST API scheme."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass

import jwt

ALGORITHM = "HS256"
LEEWAY_S = 30.0  # clock skew allowed on `exp` and `nbf`
MIN_KEY_BYTES = 32  # RFC 7518 3.2: an HS256 key at least as long as the hash


class Unauthenticated(Exception):
    """The credential is missing or not valid. Its message is for logs; callers get no detail."""


@dataclass(frozen=True)
class Principal:
    """Who a valid credential speaks for."""

    subject: str
    """The JWT's `sub`; "" for the static token (anyone holding it is the same caller)."""
    expires_at_s: float | None = None
    """Epoch seconds the credential expires at; None for the static token."""


class Authenticator:
    """Checks `authorization: Bearer <credential>` against the static token and/or the JWT keys.

    With neither configured, every caller is let in as an anonymous principal (auth is off)."""

    def __init__(self, static_token: str = "", jwt_keys: str = "", audience: str = "") -> None:
        self._static = static_token.encode()
        self._keys = parse_keys(jwt_keys)
        self._audience = audience or None

    @property
    def enabled(self) -> bool:
        return bool(self._static or self._keys)

    def verify(self, authorization: str) -> Principal:
        """The caller behind an `authorization` value; raises Unauthenticated (with a reason for the log)."""
        if not self.enabled:
            return Principal("")
        scheme, _, credential = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not credential:
            raise Unauthenticated("no bearer credential")
        return self.verify_credential(credential.strip())

    def accepts(self, authorization: str) -> bool:
        """Whether an `authorization` value is a valid credential (for doors that need no principal)."""
        try:
            self.verify(authorization)
        except Unauthenticated:
            return False
        return True

    def verify_credential(self, credential: str) -> Principal:
        if not self.enabled:
            return Principal("")
        if self._static and hmac.compare_digest(credential.encode(), self._static):
            return Principal("")
        if not self._keys:
            raise Unauthenticated("wrong token")
        try:
            key_id = jwt.get_unverified_header(credential).get("kid")
        except jwt.PyJWTError as error:
            raise Unauthenticated(f"not a token: {type(error).__name__}") from error
        keys = [self._keys[key_id]] if key_id in self._keys else list(self._keys.values())
        last: Exception = Unauthenticated("no key")
        for key in keys:
            try:
                claims = jwt.decode(
                    credential,
                    key,
                    algorithms=[ALGORITHM],
                    audience=self._audience,
                    leeway=LEEWAY_S,
                    options={"require": ["exp", "sub"], "verify_aud": self._audience is not None},
                )
            except jwt.InvalidSignatureError as error:
                last = error
                continue
            except jwt.PyJWTError as error:
                raise Unauthenticated(f"token refused: {type(error).__name__}") from error
            return Principal(str(claims["sub"]), float(claims["exp"]))
        raise Unauthenticated(f"token refused: {type(last).__name__}")


def parse_keys(spec: str) -> dict[str, bytes]:
    """`kid1:secret1,kid2:secret2` (or one bare secret, kid "default"): every key verifies, so a new key can be
    added before tokens signed with it appear and the old one removed once its tokens have expired."""
    keys: dict[str, bytes] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key_id, sep, secret = item.partition(":")
        key_id, secret = (key_id, secret) if sep else ("default", item)
        if len(secret.encode()) < MIN_KEY_BYTES:
            raise ValueError(f"JWT key {key_id!r} is shorter than {MIN_KEY_BYTES} bytes; use a longer random secret")
        if key_id in keys:
            raise ValueError(f"JWT key id {key_id!r} is given twice")
        keys[key_id] = secret.encode()
    return keys


def issue_token(jwt_keys: str, subject: str, ttl_s: float, key_id: str = "", audience: str = "") -> str:
    """A token for `subject`, signed with the key `key_id` (default: the last one given, the newest)."""
    keys = parse_keys(jwt_keys)
    if not keys:
        raise ValueError("no JWT key to sign with")
    key_id = key_id or list(keys)[-1]
    now = int(time.time())
    claims: dict[str, object] = {"sub": subject, "iat": now, "exp": now + int(ttl_s)}
    if audience:
        claims["aud"] = audience
    return jwt.encode(claims, keys[key_id], algorithm=ALGORITHM, headers={"kid": key_id})


def turn_credentials(secret: str, subject: str, ttl_s: float, now_s: float | None = None) -> tuple[str, str]:
    """(username, password) for a TURN server sharing `secret` (coturn's use-auth-secret): the username is
    `<expiry>:<subject>` and the password base64(HMAC-SHA1(secret, username)), valid until the expiry."""
    expiry = int((time.time() if now_s is None else now_s) + ttl_s)
    username = f"{expiry}:{subject or 'anonymous'}"
    digest = hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()
    return username, base64.b64encode(digest).decode()
