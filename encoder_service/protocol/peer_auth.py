"""How one replica proves to another that a row request comes from a replica of the same service, without
sending the service's bearer token (replicas/peers.py signs, api/auth.py checks).

The directory in Redis names where each id's rows are (replicas/directory.py); a replica fetches them from the
address it reads there. Whoever can write that key chooses the address, so what a replica sends there must
be of no use anywhere else: not the token, but a signature of this one request.

    key = peer_key(token)                                   # HKDF-SHA256 of the token: never the token itself
    value = sign(key, "POST", "/v1/fetch", body, to=owner)  # the Authorization header's value
    check(key, value, "POST", "/v1/fetch", body, me=owner)  # raises Unauthenticated, saying why

The signature is HMAC-SHA256 over the method, the path, the SHA-256 of the body, the time (Unix
milliseconds) and the replica it is addressed to (its owner id in the directory): the same request
replayed after WINDOW_S, or to another replica, or with another body, fails. Replicas' clocks must agree
within WINDOW_S. A replica with another token derives another key: its peers' requests fail as a
signature mismatch, not as a wrong bearer token.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from encoder_service.errors import Unauthenticated

SCHEME = "EncoderPeer"  # Authorization: EncoderPeer <to>:<unix ms>:<hex HMAC>
WINDOW_S = 30.0  # how far a signature's time may be from the checking replica's clock
_SALT = b"encoder_service peer requests"
_INFO = b"hmac-sha256 v1"
_MAX_TO = 64  # an owner id is 12 hex characters


def peer_key(token: str) -> bytes:
    """The signing key of every replica that shares `token` (HKDF-SHA256, RFC 5869, one block)."""
    prk = hmac.new(_SALT, token.encode(), hashlib.sha256).digest()
    return hmac.new(prk, _INFO + b"\x01", hashlib.sha256).digest()


def _mac(key: bytes, method: str, path: str, body: bytes, to: str, at_ms: int) -> str:
    message = b"\n".join((method.encode(), path.encode(), hashlib.sha256(body).hexdigest().encode(),
                          str(at_ms).encode(), to.encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, body: bytes, to: str, now: float | None = None) -> str:
    """The Authorization value of a request to the replica whose owner id is `to`."""
    at_ms = int((time.time() if now is None else now) * 1000)
    return f"{SCHEME} {to}:{at_ms}:{_mac(key, method, path, body, to, at_ms)}"


def is_peer(authorization: str | None) -> bool:
    return bool(authorization) and authorization.partition(" ")[0] == SCHEME


def check(key: bytes, authorization: str, method: str, path: str, body: bytes, me: str | None,
          now: float | None = None) -> None:
    """Raises Unauthenticated unless `authorization` signs this request, to `me`, within WINDOW_S."""
    fields = authorization.partition(" ")[2].split(":")
    if len(fields) != 3 or len(fields[0]) > _MAX_TO or not fields[1].isdigit():
        raise Unauthenticated(f"authorization must be '{SCHEME} <replica>:<unix ms>:<hex HMAC>'")
    to, at, mac = fields
    if me is None or to != me:
        raise Unauthenticated(f"peer request addressed to replica {to!r:.70}, not this one: the directory in Redis "
                              "names another address for it")
    skew = abs((time.time() if now is None else now) - int(at) / 1000)
    if skew > WINDOW_S:
        raise Unauthenticated(f"peer request signed {skew:.0f} s away from this replica's clock (more than "
                              f"{WINDOW_S:g} s: replayed, or the replicas' clocks disagree)")
    if not hmac.compare_digest(mac.encode(), _mac(key, method, path, body, to, int(at)).encode()):
        raise Unauthenticated("peer signature mismatch: the replicas do not share one --auth-token")
