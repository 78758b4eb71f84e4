"""protocol/peer_auth.py and api/auth.py: a replica's row request signed with a key derived from the token (never
the token), accepted only as that request, to that replica, within the clock window (issue 38)."""

from __future__ import annotations

import pytest

from encoder_service.api.auth import BearerAuth
from encoder_service.errors import Unauthenticated
from encoder_service.protocol.peer_auth import SCHEME, WINDOW_S, check, peer_key, sign

KEY = peer_key("the-token")
BODY = b'{"items": [{"id": "u:a", "offset": 0}], "start": 0, "end": 4, "timeout_s": 0, "peer": "copy"}'
NOW = 1_800_000_000.0


def test_a_signed_request_is_accepted_and_carries_no_token():
    value = sign(KEY, "POST", "/v1/fetch", BODY, "owner1", now=NOW)
    assert value.startswith(f"{SCHEME} owner1:") and "the-token" not in value and KEY.hex() not in value
    check(KEY, value, "POST", "/v1/fetch", BODY, me="owner1", now=NOW + WINDOW_S - 1)
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
    args = dict(key=KEY, method="POST", path="/v1/fetch", body=BODY, me="owner1", now=NOW) | change
    with pytest.raises(Unauthenticated, match=why):
        check(args["key"], value, args["method"], args["path"], args["body"], me=args["me"], now=args["now"])


@pytest.mark.parametrize("value", [SCHEME, f"{SCHEME} owner1:later:ab", f"{SCHEME} a:b", f"{SCHEME} {'x' * 80}:1:ab"])
def test_a_malformed_signature_is_refused(value):
    with pytest.raises(Unauthenticated, match="must be"):
        check(KEY, value, "POST", "/v1/fetch", BODY, me="owner1")


def test_the_bearer_check_takes_no_signature_and_a_signature_needs_a_token():
    auth = BearerAuth("the-token")
    signed = sign(KEY, "POST", "/v1/fetch", BODY, "owner1")
    with pytest.raises(Unauthenticated, match=r"fetch of rows only \(POST /v1/fetch\)"):
        auth.check(signed)  # any other route
    assert auth.signed_by_peer(signed) and not auth.signed_by_peer("Bearer the-token")
    auth.check_peer(signed, "POST", "/v1/fetch", BODY, me="owner1")
    assert not BearerAuth(None).signed_by_peer(signed)  # auth off: nothing to check
