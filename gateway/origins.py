"""Which web pages may open sessions on the gateway's browser doors."""

from __future__ import annotations

from urllib.parse import urlsplit

import grpc

from voicemesh.errors import RequestError


class OriginPolicy:
    """The gateway's own origin, plus a configured list ("*" = any)."""

    def __init__(self, allowed_origins: str) -> None:
        self.allowed = {origin.strip().rstrip("/").lower() for origin in allowed_origins.split(",") if origin.strip()}

    def check(self, origin: str | None, host: str) -> None:
        """Raises PERMISSION_DENIED for a foreign page. No Origin header means no browser, so no page to forge."""
        if origin is None or "*" in self.allowed:
            return
        try:
            netloc = urlsplit(origin).netloc.lower()
        except ValueError:  # not a URL (an unclosed IPv6 bracket): no page of this gateway's
            netloc = ""
        if (netloc and netloc == host.lower()) or origin.rstrip("/").lower() in self.allowed:
            return
        raise RequestError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"pages from {origin} may not open sessions on this gateway; its operator can allow them with "
            "--allowed-origins",
        )
