"""Optional bearer-token auth shared by HTTP and gRPC. Health endpoints stay open (the transports decide).

Another replica fetching rows (replicas/peers.py) sends no token: it signs its request with a key derived from the
token (protocol/peer_auth.py), which this accepts on the row path only: `signed_by_peer` says a request is
one, `addressed_to` checks what it can before the body is read, `check_peer` the signature of the body."""

from __future__ import annotations

import hmac

from encoder_service.errors import Unauthenticated
from encoder_service.protocol import peer_auth


class BearerAuth:
    def __init__(self, token: str | None):
        self._token = token.encode() if token else None
        self._peer_key = peer_auth.peer_key(token) if token else None
        self._seen = peer_auth.Seen()  # signatures taken: none is taken twice

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
        if peer_auth.is_peer(authorization):
            raise Unauthenticated("a replica's signature authorizes its fetch of rows only (POST /v1/fetch)")
        if scheme.lower() != "bearer" or not given:
            raise Unauthenticated("authorization must be 'Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), self._token):
            raise Unauthenticated("wrong bearer token")

    def signed_by_peer(self, authorization: str | None) -> bool:
        """The request says it is another replica's (checked: `addressed_to`, then with its body `check_peer`);
        else `check` it."""
        return self._peer_key is not None and peer_auth.is_peer(authorization)

    def addressed_to(self, authorization: str, me: str | None) -> peer_auth.Signature:
        """Raises Unauthenticated unless `authorization` is a replica's signature in form, addressed to this
        replica (`me`: its owner id in the directory; None: no Redis, so no peers) and signed in time."""
        return peer_auth.addressed(authorization, me)

    def check_peer(self, signature: peer_auth.Signature, method: str, path: str, body: bytes) -> None:
        """Raises Unauthenticated unless `signature` (`addressed_to`) signs this request, and was not taken
        before (a replayed request)."""
        peer_auth.check(self._peer_key, signature, method, path, body, self._seen)
