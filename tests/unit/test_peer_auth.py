"""protocol/peer_auth.py and api/auth.py: a replica's row request signed with a key derived from the token (never
the token), accepted only as that request, to that replica, within the clock window, once (issue 38)."""

from __future__ import annotations

import pytest

from encoder_service.api.auth import BearerAuth
from encoder_service.errors import Unauthenticated
from encoder_service.protocol.peer_auth import SCHEME, WINDOW_S, Seen, addressed, check, peer_key, sign

KEY = peer_key("the-token")
BODY = b'{"items": [{"id": "u:a", "offset": 0}], "start": 0, "end": 4, "timeout_s": 0, "peer": "copy"}'
NOW = 1_800_000_000.0


def checked(value: str, *, key=KEY, method="POST", path="/v1/fetch", body=BODY, me="owner1", now=NOW, seen=None):
    check(key, addressed(value, me, now=now), method, path, body, seen if seen is not None else Seen(), now=now)


def test_a_signed_request_is_accepted_and_carries_no_token():
    value = sign(KEY, "POST", "/v1/fetch", BODY, "owner1", now=NOW)
    assert value.startswith(f"{SCHEME} owner1:") and "the-token" not in value and KEY.hex() not in value
    checked(value, now=NOW + WINDOW_S - 1)
    assert peer_key("the-token") == KEY and peer_key("another") != KEY


@pytest.mark.parametrize("change, why", [
    (dict(body=BODY.replace(b'"end": 4', b'"end": 5')), "mismatch"),
    (dict(path="/v1/release"), "mismatch"),
    (dict(method="GET"), "mismatch"),
    (dict(key=peer_key("another-token")), "do not share one --auth-token"),
    (dict(me="owner2"), "not this one"),
    (dict(me=None), "not this one"),
    (dict(now=NOW + WINDOW_S + 1), "replayed, or the replicas' clocks disagree"),
    (dict(now=NOW - WINDOW_S - 1), "clocks disagree"),
])
def test_anything_but_that_request_to_that_replica_in_time_is_refused(change, why):
    value = sign(KEY, "POST", "/v1/fetch", BODY, "owner1", now=NOW)
    with pytest.raises(Unauthenticated, match=why):
        checked(value, **change)


@pytest.mark.parametrize("value", [
    SCHEME, f"{SCHEME} owner1:1800000000000:ab", f"{SCHEME} a:b", f"{SCHEME} {'x' * 80}:1:{'0' * 16}:{'a' * 64}",
    f"{SCHEME} owner1:later:{'0' * 16}:{'a' * 64}",
    f"{SCHEME} owner1:1800000000000:nonce:{'a' * 64}", f"{SCHEME} owner1:1800000000000:{'0' * 16}:xyz",
    # str.isdigit takes these; int() refused the first and read the second (a 500, not a 401)
    f"{SCHEME} owner1:²:{'0' * 16}:{'a' * 64}", f"{SCHEME} owner1:١٨٠٠٠٠٠٠٠٠٠٠٠:{'0' * 16}:{'a' * 64}",
    f"{SCHEME} owner1:{'9' * 17}:{'0' * 16}:{'a' * 64}", f"{SCHEME} owner1:{'9' * 5000}:{'0' * 16}:{'a' * 64}",
])
def test_a_malformed_signature_is_refused_saying_why(value):
    with pytest.raises(Unauthenticated, match="must be"):
        addressed(value, "owner1", now=NOW)


def test_a_signature_is_taken_once_and_each_request_signs_anew():
    """A captured peer fetch sent again within the window counted its deliveries again (ending pins)."""
    seen = Seen()
    first, again = (sign(KEY, "POST", "/v1/fetch", BODY, "owner1", now=NOW) for _ in range(2))
    assert first != again  # the same request in the same millisecond: another nonce, another MAC
    checked(first, seen=seen)
    checked(again, seen=seen)
    with pytest.raises(Unauthenticated, match="replayed: this signature was already taken"):
        checked(first, seen=seen, now=NOW + 1)


def test_past_its_bound_a_replay_is_still_refused():
    seen = Seen(bound=2)
    values = [sign(KEY, "POST", "/v1/fetch", BODY, "owner1", now=NOW + k / 1000) for k in range(4)]
    late = sign(KEY, "POST", "/v1/fetch", BODY, "owner1", now=NOW)  # signed as early as the first, sent last
    for value in values[:3]:
        checked(value, seen=seen, now=NOW + 1)
    assert seen.floor_ms == int(NOW * 1000)  # the first forgotten: what was signed no later is refused
    for value in (values[0], late):
        with pytest.raises(Unauthenticated, match="too many at once"):
            checked(value, seen=seen, now=NOW + 1)
    checked(values[3], seen=seen, now=NOW + 1)
    with pytest.raises(Unauthenticated, match="already taken"):
        checked(values[2], seen=seen, now=NOW + 1)


def test_signatures_out_of_the_window_are_forgotten():
    seen = Seen()
    for k in range(5):
        checked(sign(KEY, "POST", "/v1/fetch", BODY, "owner1", now=NOW + k), seen=seen, now=NOW + k)
    checked(sign(KEY, "POST", "/v1/fetch", BODY, "owner1", now=NOW + 40), seen=seen, now=NOW + 40)
    assert len(seen._macs) == 1 and seen.floor_ms == -1  # the window refuses them: nothing raised the floor


def test_the_bearer_check_takes_no_signature_and_a_signature_needs_a_token():
    auth = BearerAuth("the-token")
    signed = sign(KEY, "POST", "/v1/fetch", BODY, "owner1")
    with pytest.raises(Unauthenticated, match=r"fetch of rows only \(POST /v1/fetch\)"):
        auth.check(signed)  # any other route
    assert auth.signed_by_peer(signed) and not auth.signed_by_peer("Bearer the-token")
    auth.check_peer(auth.addressed_to(signed, "owner1"), "POST", "/v1/fetch", BODY)
    assert not BearerAuth(None).signed_by_peer(signed)  # auth off: nothing to check
