"""Credentials: the static token, JWTs with rotating keys, and TURN REST API credentials."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import jwt
import pytest

from voicemesh.auth import Authenticator, Principal, Unauthenticated, issue_token, parse_keys, turn_credentials

OLD = "old:" + "o" * 32
NEW = "new:" + "n" * 32


def test_without_credentials_configured_everyone_is_anonymous() -> None:
    authenticator = Authenticator()
    assert not authenticator.enabled
    assert authenticator.verify("") == Principal("")


def test_the_static_token_is_the_simple_mode() -> None:
    authenticator = Authenticator(static_token="s3cret")
    assert authenticator.verify("Bearer s3cret") == Principal("")
    for wrong in ("", "s3cret", "Bearer s3cre", "Basic s3cret", "Bearer "):
        with pytest.raises(Unauthenticated):
            authenticator.verify(wrong)


def test_a_jwt_carries_its_subject_and_expiry_and_both_keys_verify_during_a_rotation() -> None:
    authenticator = Authenticator(jwt_keys=f"{OLD},{NEW}")
    for key_id in ("old", "new"):
        token = issue_token(f"{OLD},{NEW}", "alice", ttl_s=60, key_id=key_id)
        principal = authenticator.verify(f"Bearer {token}")
        assert principal.subject == "alice"
        assert principal.expires_at_s is not None and 0 < principal.expires_at_s - time.time() <= 61
    assert jwt.get_unverified_header(issue_token(f"{OLD},{NEW}", "bob", 60))["kid"] == "new"  # the newest signs
    # After the rotation the old key is gone, and so are its tokens.
    old_token = issue_token(OLD, "alice", ttl_s=60)
    with pytest.raises(Unauthenticated):
        Authenticator(jwt_keys=NEW).verify(f"Bearer {old_token}")


@pytest.mark.parametrize(
    "claims",
    [
        {"sub": "alice", "exp": int(time.time()) - 120},  # expired (beyond the 30 s leeway)
        {"sub": "alice"},  # no expiry
        {"exp": int(time.time()) + 60},  # no subject
    ],
    ids=["expired", "no-exp", "no-sub"],
)
def test_an_expired_or_incomplete_token_is_refused(claims: dict[str, object]) -> None:
    token = jwt.encode(claims, "n" * 32, algorithm="HS256", headers={"kid": "new"})
    with pytest.raises(Unauthenticated):
        Authenticator(jwt_keys=NEW).verify(f"Bearer {token}")


def test_a_wrongly_signed_or_unsigned_token_is_refused() -> None:
    forged = jwt.encode({"sub": "mallory", "exp": int(time.time()) + 60}, "x" * 32, algorithm="HS256")
    unsigned = jwt.encode({"sub": "mallory", "exp": int(time.time()) + 60}, None, algorithm="none")
    for token in (forged, unsigned, "not.a.token"):
        with pytest.raises(Unauthenticated):
            Authenticator(jwt_keys=NEW).verify(f"Bearer {token}")


def test_the_audience_is_checked_when_configured() -> None:
    token = issue_token(NEW, "alice", 60, audience="voicemesh")
    assert Authenticator(jwt_keys=NEW, audience="voicemesh").verify(f"Bearer {token}").subject == "alice"
    with pytest.raises(Unauthenticated):
        Authenticator(jwt_keys=NEW, audience="other").verify(f"Bearer {token}")


def test_weak_or_duplicate_keys_are_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="shorter than 32 bytes"):
        parse_keys("k:short")
    with pytest.raises(ValueError, match="given twice"):
        parse_keys(f"{NEW},{NEW}")
    assert parse_keys("z" * 32) == {"default": b"z" * 32}


def test_turn_credentials_follow_the_turn_rest_api_scheme() -> None:
    username, password = turn_credentials("turn-secret", "alice", ttl_s=600, now_s=1_800_000_000)
    assert username == "1800000600:alice"
    expected = base64.b64encode(hmac.new(b"turn-secret", b"1800000600:alice", hashlib.sha1).digest()).decode()
    assert password == expected
