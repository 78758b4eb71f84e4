"""Optional bearer-token auth shared by HTTP and gRPC. Health endpoints stay open (the transports decide)."""

from __future__ import annotations

import hmac

from encoder_service.errors import Unauthenticated


class BearerAuth:
    def __init__(self, token: str | None):
        self._token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, authorization: str | None) -> None:
        """Raises Unauthenticated unless `authorization` is "Bearer <token>" (or auth is off).

        `authorization` is the HTTP Authorization header or the gRPC `authorization` metadata value.
        """
        if self._token is None:
            return
        if not authorization:
            raise Unauthenticated("missing bearer token (send 'authorization: Bearer <token>')")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise Unauthenticated("authorization must be 'Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), self._token):
            raise Unauthenticated("wrong bearer token")
