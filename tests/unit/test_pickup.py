"""Pickup tickets (api/pickup.py): unguessable, single use, short-lived, bounded."""

from __future__ import annotations

import torch

from encoder_service.api.pickup import Pickups
from encoder_service.protocol.wire import WireHeader
from encoder_service.ranges import Segment


def _rows(n: int):
    rows = torch.zeros(n, 4)
    return WireHeader("float32", 4, "main", (Segment("a", 0, 0, n),)), rows


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_ticket_works_once_and_names_its_rows():
    pickups = Pickups()
    header, rows = _rows(3)
    token = pickups.put(header, rows)
    assert len(token) >= 43 and token != pickups.put(*_rows(3))  # 256 random bits, base64url
    got_header, got_rows = pickups.take(token)
    assert got_header == header and got_rows is rows
    assert pickups.take(token) is None and pickups.take("made-up") is None


def test_tickets_expire_and_are_dropped_without_a_timer():
    clock = Clock()
    pickups = Pickups(ttl_s=10, clock=clock)
    old = pickups.put(*_rows(2))
    clock.now = 9.0
    young = pickups.put(*_rows(2))
    clock.now = 10.5
    assert pickups.take(old) is None  # expired
    pickups.put(*_rows(2))  # making a ticket drops the expired ones
    assert len(pickups) == 2 and pickups.take(young) is not None


def test_waiting_rows_are_bounded():
    header, rows = _rows(4)  # 64 bytes
    pickups = Pickups(max_tickets=3, max_bytes=150)
    assert pickups.put(header, rows) and pickups.put(header, rows)
    assert pickups.put(header, rows) is None  # 192 bytes would wait
    small = Pickups(max_tickets=1)
    assert small.put(header, rows) and small.put(header, rows) is None
