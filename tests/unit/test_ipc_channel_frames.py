"""The same-host channel's frames (protocol/ipc_channel.py) both ways; what is not a frame is refused."""

from __future__ import annotations

import math
import struct

import pytest

from encoder_service.protocol import ipc_channel as proto
from encoder_service.protocol.ipc import MAX_ACK_TOKENS, IpcPlacement, IpcUnavailable
from encoder_service.protocol.wire import WireHeader
from encoder_service.ranges import Segment

ITEMS = [("u:a", 3), ("v:b#1", 40), ("u:a", 90)]  # one id twice, at two offsets


def body(data: bytes) -> bytes:
    return data[proto.PREFIX.size:]


@pytest.mark.parametrize("token", ["0123456789abcdef" * 2, None])  # a hold, a probe
def test_a_placed_answer_reads_back_as_it_was_written(token):
    header = WireHeader("bfloat16", 2048, "main", (Segment("u:a", 5, 2, 9), Segment("v:b#1", 40, 0, 4),
                                                     Segment("u:a", 90, 0, 1)))
    placed = IpcPlacement("cuda", bytes(range(64)), "g1", 1 << 30, (0, 4096, 8192), token, 5.5)
    got_header, got = proto.read_placed(body(proto.placed(7, ITEMS, header, placed)), ITEMS)
    assert got_header == header and got == placed


def test_fetch_ack_unplaced_and_error_read_back():
    tokens = ("ab" * 16, "cd" * 16)
    assert proto.read_fetch(body(proto.fetch_request(1, ITEMS, 0, 100, None, True, tokens))) == (
        ITEMS, 0, 100, None, True, tokens)
    items, _, _, timeout_s, hold, _ = proto.read_fetch(body(proto.fetch_request(2, ITEMS[:1], 5, 6, 2.5, False, ())))
    assert (items, timeout_s, hold) == (ITEMS[:1], 2.5, False) and not math.isnan(timeout_s)
    assert proto.read_ack(body(proto.ack_request(tokens))) == tokens
    assert proto.read_unplaced(body(proto.unplaced(3, IpcUnavailable("why", "http://x:1")))) == IpcUnavailable(
        "why", "http://x:1")
    assert proto.read_error(body(proto.error(4, "not_found", "no such id"))) == ("not_found", "no such id")


@pytest.mark.parametrize("bad, says", [
    (lambda: proto.ack_request(["nothex"]), "hold token"),
    (lambda: proto.fetch_request(1, [("x" * 70000, 0)], 0, 1, None, True, ()), "string of"),
    (lambda: proto.read_ack(b"\x01\x00\x00"), "shorter"),
    (lambda: proto.read_ack(b"\x00\x00\x00"), "past a frame"),
])
def test_what_is_not_a_frame_is_refused(bad, says):
    with pytest.raises(proto.ChannelError, match=says):
        bad()


def test_a_placed_answer_of_a_segment_no_item_names_is_refused():
    """Before: a KeyError (the channel's fetch answered "internal")."""
    header = WireHeader("bfloat16", 2048, "main", (Segment("u:other", 0, 0, 4),))
    placed = IpcPlacement("cuda", bytes(64), "g1", 1 << 20, (0,), None, 5.0)
    with pytest.raises(proto.ChannelError, match="no item of the fetch"):
        proto.placed(1, ITEMS, header, placed)
    with pytest.raises(ValueError, match="63-byte IPC handle"):
        proto.placed(1, ITEMS, WireHeader("bfloat16", 2048, "main", ()), IpcPlacement(
            "cuda", bytes(63), "g1", 1 << 20, (), None, 5.0))


@pytest.mark.parametrize("start, end", [(0, 1 << 63), (-(1 << 63) - 1, 4)])
def test_a_position_outside_int64_is_a_channel_error(start, end):
    """Before: struct.error, which the client did not catch."""
    with pytest.raises(proto.ChannelError, match="can't carry"):
        proto.fetch_request(1, ITEMS, start, end, None, True, ())


def test_acknowledgements_are_bounded_both_ways():
    with pytest.raises(proto.ChannelError, match="hold tokens"):
        proto.ack_request(["ab" * 16] * (MAX_ACK_TOKENS + 1))
    with pytest.raises(proto.ChannelError, match="hold tokens"):
        proto.read_ack(struct.pack("<H", MAX_ACK_TOKENS + 1) + bytes(16 * (MAX_ACK_TOKENS + 1)))


def test_a_prefix_over_its_limit_is_refused():
    assert proto.read_prefix(proto.hello("t")[:proto.PREFIX.size], proto.MAX_HELLO)[1] == proto.HELLO
    with pytest.raises(proto.ChannelError, match="at most 4096"):
        proto.read_prefix(proto.hello("t" * 5000)[:proto.PREFIX.size], proto.MAX_HELLO)
