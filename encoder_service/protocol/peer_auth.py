"""How one replica proves to another that a row request comes from a replica of the same service, without
sending the service's bearer token (replicas/peers.py signs, api/auth.py checks).

The directory in Redis names where each id's rows are (replicas/directory.py); a replica fetches them from the
address it reads there. Whoever can write that key chooses the address, so what a replica sends there must
be of no use anywhere else: not the token, but a signature of this one request.

    key = peer_key(token)                                   # HKDF-SHA256 of the token: never the token itself
    value = sign(key, "POST", "/v1/fetch", body, to=owner)  # the Authorization header's value
    signature = addressed(value, me=owner)                  # its form, its replica, its time: before the body
    check(key, signature, "POST", "/v1/fetch", body, seen)  # raises Unauthenticated, saying why

The signature is HMAC-SHA256 over the method, the path, the SHA-256 of the body, the time (Unix
milliseconds), the replica it is addressed to (its owner id in the directory) and a random nonce: the same
request replayed after WINDOW_S, or to another replica, or with another body, fails, and so does one replayed
within WINDOW_S (the checking replica remembers the signatures it took: `Seen`). Replicas' clocks must agree
within WINDOW_S. A replica with another token derives another key: its peers' requests fail as a signature
mismatch, not as a wrong bearer token. What `addressed` checks needs no body, so a request that fails it is
answered before its body is read; one that passes has its body read up to MAX_BODY_BYTES only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from encoder_service.errors import Unauthenticated

SCHEME = "EncoderPeer"  # Authorization: EncoderPeer <to>:<unix ms>:<nonce>:<hex HMAC>
WINDOW_S = 30.0  # how far a signature's time may be from the checking replica's clock
MAX_BODY_BYTES = 8 << 10  # a peer's fetch: one item (an id of at most ~140 characters), about 150 bytes of JSON
SEEN = 1 << 16  # signatures remembered (each ~200 bytes): a replica's peer fetches within WINDOW_S
_SALT = b"encoder_service peer requests"
_INFO = b"hmac-sha256 v1"
_MAX_TO = 64  # an owner id is 12 hex characters
_MAX_MS_DIGITS = 16  # Unix milliseconds have 13 digits until the year 2286
_NONCE_HEX = 16  # 8 random bytes
_FORM = f"authorization must be '{SCHEME} <replica>:<unix ms>:<nonce>:<hex HMAC>'"


def peer_key(token: str) -> bytes:
    """The signing key of every replica that shares `token` (HKDF-SHA256, RFC 5869, one block)."""
    prk = hmac.new(_SALT, token.encode(), hashlib.sha256).digest()
    return hmac.new(prk, _INFO + b"\x01", hashlib.sha256).digest()


def _mac(key: bytes, method: str, path: str, body: bytes, to: str, at_ms: int, nonce: str) -> str:
    message = b"\n".join((method.encode(), path.encode(), hashlib.sha256(body).hexdigest().encode(),
                          str(at_ms).encode(), to.encode(), nonce.encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, body: bytes, to: str, now: float | None = None) -> str:
    """The Authorization value of a request to the replica whose owner id is `to` (a fresh nonce each)."""
    at_ms, nonce = int((time.time() if now is None else now) * 1000), secrets.token_hex(_NONCE_HEX // 2)
    return f"{SCHEME} {to}:{at_ms}:{nonce}:{_mac(key, method, path, body, to, at_ms, nonce)}"


def is_peer(authorization: str | None) -> bool:
    return bool(authorization) and authorization.partition(" ")[0] == SCHEME


@dataclass(frozen=True)
class Signature:
    """An Authorization value's fields, its form checked (`addressed`)."""

    to: str
    at_ms: int
    nonce: str
    mac: str


def addressed(authorization: str, me: str | None, now: float | None = None) -> Signature:
    """What can be checked before the body is read: the value's form, that it is addressed to `me` (None: no
    Redis, so no peers) and signed within WINDOW_S of this clock. Raises Unauthenticated saying why."""
    fields = authorization.partition(" ")[2].split(":")
    if len(fields) != 4:
        raise Unauthenticated(_FORM)
    to, at, nonce, mac = fields
    # isascii: str.isdigit takes '²' and other scripts' digits, which int() refuses or reads as other numbers
    if len(to) > _MAX_TO or not (at.isascii() and at.isdigit() and len(at) <= _MAX_MS_DIGITS):
        raise Unauthenticated(f"{_FORM}: the time must be at most {_MAX_MS_DIGITS} ASCII digits")
    if not (len(nonce) == _NONCE_HEX and _hex(nonce)) or not (len(mac) == 64 and _hex(mac)):
        raise Unauthenticated(f"{_FORM}: the nonce is {_NONCE_HEX} hex digits, the HMAC 64")
    if me is None or to != me:
        raise Unauthenticated(f"peer request addressed to replica {to!r:.70}, not this one: the directory in Redis "
                              "names another address for it")
    skew = abs((time.time() if now is None else now) - int(at) / 1000)
    if skew > WINDOW_S:
        raise Unauthenticated(f"peer request signed {skew:.0f} s away from this replica's clock (more than "
                              f"{WINDOW_S:g} s: replayed, or the replicas' clocks disagree)")
    return Signature(to, int(at), nonce, mac)


def check(key: bytes, signature: Signature, method: str, path: str, body: bytes, seen: Seen,
          now: float | None = None) -> None:
    """Raises Unauthenticated unless `signature` (`addressed`) signs this request and was not taken before."""
    expected = _mac(key, method, path, body, signature.to, signature.at_ms, signature.nonce)
    if not hmac.compare_digest(signature.mac.encode(), expected.encode()):
        raise Unauthenticated("peer signature mismatch: the replicas do not share one --auth-token")
    seen.take(signature, now)


class Seen:
    """The signatures a replica took within WINDOW_S, so that none is taken twice (a captured peer fetch sent
    again would count its deliveries again and end pins). Bounded: past `bound` the oldest taken is forgotten
    and every signature made no later than it is refused from then on (`floor_ms`): under a flood of peer
    fetches a replay is still refused, at the cost of refusing late-arriving genuine ones (their replica signs
    anew on its next fetch). Only signatures whose HMAC matched come here: nobody else can fill it."""

    def __init__(self, bound: int = SEEN):
        self._bound, self._macs, self._lock = bound, OrderedDict(), threading.Lock()
        self.floor_ms = -1  # signatures made at or before this are refused (forgotten ones were)

    def take(self, signature: Signature, now: float | None = None) -> None:
        oldest_ms = int(((time.time() if now is None else now) - WINDOW_S) * 1000)
        with self._lock:
            if signature.mac in self._macs:
                raise Unauthenticated("peer request replayed: this signature was already taken")
            if signature.at_ms <= self.floor_ms:
                raise Unauthenticated(f"peer request signed before the last {self._bound} this replica took "
                                      "(too many at once to tell a replay): its replica signs afresh next time")
            self._macs[signature.mac] = signature.at_ms
            while self._macs:  # forget what WINDOW_S refuses anyway, then the oldest past the bound
                mac, at_ms = next(iter(self._macs.items()))
                if at_ms >= oldest_ms and len(self._macs) <= self._bound:
                    break
                del self._macs[mac]
                if at_ms >= oldest_ms:
                    self.floor_ms = max(self.floor_ms, at_ms)


def _hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)
