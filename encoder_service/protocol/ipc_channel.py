"""The same-host channel of the fetch by IPC, both ends: a Unix domain socket the server listens on
(api/ipc_channel.py; its path in /v1/metadata's "ipc": "channel") and a consumer on this host keeps one
connection to (client/ipc_channel.py), beside HTTP. An IPC fetch's answer is a few hundred bytes: over HTTP
most of its time is the request itself (parsing, routing, headers on both ends); here it is one small frame
each way on a connection made once.

Every frame: u32 length of what follows (at most MAX_FRAME), u8 type, u32 request id, then its body
(little-endian; a string is u16 length + UTF-8; a hold token is its 16 bytes, the 32 hex digits decoded):

  HELLO     c -> s  u8 version, the bearer token (the rest: UTF-8, empty without one; the frame at most
                    MAX_HELLO). First, once per connection; answered HELLO (empty), or ERROR and the
                    connection closed.
  FETCH     c -> s  i64 start, i64 end, f64 timeout_s (NaN: none), u8 hold, u16 n + n tokens to acknowledge,
                    u16 n + n items (i64 offset, string id). The answer carries the request's id (several
                    fetches may be in flight on one connection; answers come in any order).
  ACK       c -> s  u16 n + n tokens (their copies are done; at most MAX_ACK_TOKENS); no answer.
  PLACED    s -> c  string dtype, u32 row_width, string layout, u32 n + n segments (u32 item index, u32
                    row_start, u32 row_end, u64 arena offset), string kind, 64-byte handle, string
                    generation, u64 arena size, u8 held + token, f64 lease_s: protocol/ipc.py's IpcPlacement
                    and the wire header's fields (a segment's position is its item's offset + row_start).
  UNPLACED  s -> c  string reason, string owner ("": none): IpcUnavailable (no segments).
  ERROR     s -> c  string kind (protocol/errors.py), string message: the request's error, as HTTP's.

The connection is the consumer's host's by construction (a Unix socket is reached through this kernel): the
server answers it as a consumer with its own boot id.
"""

from __future__ import annotations

import asyncio
import math
import struct

from encoder_service.protocol.ipc import HANDLE_BYTES, MAX_ACK_TOKENS, TOKEN_RE, IpcPlacement, IpcUnavailable
from encoder_service.protocol.wire import WireHeader
from encoder_service.ranges import Segment

VERSION = 1
MAX_FRAME = 1 << 20  # bytes of one frame after its length: a fetch of 16 x --max-images ids fits with room
MAX_HELLO = 4096  # a HELLO's (read before the token is checked): a version and a bearer token
MAX_ITEMS = 1 << 16
HELLO, FETCH, ACK, PLACED, UNPLACED, ERROR = 1, 2, 3, 4, 5, 6
PREFIX = struct.Struct("<IBI")  # length of the rest, type, request id
_FETCH = struct.Struct("<qqdB")
_U16, _U32 = struct.Struct("<H"), struct.Struct("<I")
_ITEM = struct.Struct("<q")
_SEGMENT = struct.Struct("<IIIQ")
_PLACED_TAIL = struct.Struct("<Q")
_LEASE = struct.Struct("<d")


class ChannelError(ValueError):
    """A frame that is not one (either end): the connection is closed."""


def read_prefix(prefix: bytes, limit: int = MAX_FRAME) -> tuple[int, int, int]:
    """(bytes of the body that follows, type, request id) of a frame's PREFIX; ChannelError for a length
    outside [5, limit]."""
    length, kind, request_id = PREFIX.unpack(prefix)
    if not 5 <= length <= limit:
        raise ChannelError(f"a frame of {length} bytes (at most {limit})")
    return length - 5, kind, request_id


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> tuple[int, int, bytes]:
    """(type, request id, body) of the next frame on an asyncio stream (IncompleteReadError at its end)."""
    n, kind, request_id = read_prefix(await reader.readexactly(PREFIX.size), limit)
    return kind, request_id, await reader.readexactly(n)


def frame(kind: int, request_id: int, body: bytes = b"") -> bytes:
    if len(body) + 5 > MAX_FRAME:
        raise ChannelError(f"a frame of {len(body) + 5} bytes, over the limit of {MAX_FRAME}")
    return PREFIX.pack(len(body) + 5, kind, request_id) + body


def _string(text: str) -> bytes:
    data = text.encode()
    if len(data) > 0xFFFF:
        raise ChannelError(f"a string of {len(data)} bytes in a frame (at most 65535)")
    return _U16.pack(len(data)) + data


def _tokens(tokens) -> bytes:
    tokens = list(tokens)
    if len(tokens) > MAX_ACK_TOKENS:
        raise ChannelError(f"{len(tokens)} hold tokens in a frame (at most {MAX_ACK_TOKENS})")
    bad = next((t for t in tokens if not TOKEN_RE.match(t)), None)
    if bad is not None:
        raise ChannelError(f"{bad!r:.60} is not a hold token (32 hex digits)")
    return _U16.pack(len(tokens)) + b"".join(bytes.fromhex(t) for t in tokens)


class Reader:
    """Reads a frame's body in order; ChannelError past its end."""

    def __init__(self, body: bytes | memoryview):
        self._body, self._at = memoryview(body), 0

    def take(self, n: int) -> memoryview:
        if self._at + n > len(self._body):
            raise ChannelError("a frame shorter than its fields")
        got = self._body[self._at:self._at + n]
        self._at += n
        return got

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack(self.take(fmt.size))

    def string(self) -> str:
        (n,) = self.unpack(_U16)
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise ChannelError("a string in a frame that is not UTF-8") from None

    def tokens(self) -> tuple[str, ...]:
        (n,) = self.unpack(_U16)
        if n > MAX_ACK_TOKENS:
            raise ChannelError(f"{n} hold tokens in a frame (at most {MAX_ACK_TOKENS})")
        return tuple(self.take(16).hex() for _ in range(n))

    def end(self) -> None:
        if self._at != len(self._body):
            raise ChannelError(f"{len(self._body) - self._at} bytes past a frame's fields")


# ---- requests (consumer -> server) ----------------------------------------------------------------------------
def hello(token: str | None) -> bytes:
    return frame(HELLO, 0, bytes([VERSION]) + (token or "").encode())


def read_hello(body: bytes) -> str:
    """The token a HELLO carries ("" without one); ChannelError for another version."""
    if not body or body[0] != VERSION:
        raise ChannelError(f"channel version {body[0] if body else None}, this server speaks {VERSION}")
    try:
        return body[1:].decode()
    except UnicodeDecodeError:
        raise ChannelError("a token that is not UTF-8") from None


def fetch_request(request_id: int, items, start: int, end: int, timeout_s: float | None, hold: bool,
                  ack) -> bytes:
    """ChannelError for a fetch the channel can't carry (HTTP can: its server answers what is wrong)."""
    items = list(items)
    if len(items) >= MAX_ITEMS:
        raise ChannelError(f"{len(items)} items in one fetch (the channel takes fewer than {MAX_ITEMS})")
    try:
        body = [_FETCH.pack(start, end, math.nan if timeout_s is None else timeout_s, hold), _tokens(ack),
                _U16.pack(len(items))]
        body += [_ITEM.pack(offset) + _string(item_id) for item_id, offset in items]
    except struct.error as exc:  # a start, end or offset outside int64
        raise ChannelError(f"a fetch the channel can't carry: {exc}") from None
    return frame(FETCH, request_id, b"".join(body))


def read_fetch(body: bytes) -> tuple[list[tuple[str, int]], int, int, float | None, bool, tuple[str, ...]]:
    """(items, start, end, timeout_s, hold, tokens to acknowledge) of a FETCH body."""
    r = Reader(body)
    start, end, timeout_s, hold = r.unpack(_FETCH)
    ack = r.tokens()
    (n,) = r.unpack(_U16)
    items = []
    for _ in range(n):
        (offset,) = r.unpack(_ITEM)
        items.append((r.string(), offset))
    r.end()
    return items, start, end, None if math.isnan(timeout_s) else timeout_s, bool(hold), ack


def ack_request(tokens) -> bytes:
    return frame(ACK, 0, _tokens(tokens))


def read_ack(body: bytes) -> tuple[str, ...]:
    r = Reader(body)
    tokens = r.tokens()
    r.end()
    return tokens


# ---- answers (server -> consumer) -----------------------------------------------------------------------------
def placed(request_id: int, items, header: WireHeader, p: IpcPlacement) -> bytes:
    """The PLACED answer to a fetch of `items` ((id, offset) pairs, as the request named them); ChannelError
    when a segment is of no item requested (the fetch named its id otherwise), ValueError when the handle is not
    HANDLE_BYTES long (the server's arena's: a bug)."""
    index = {(item_id, offset): k for k, (item_id, offset) in enumerate(items)}
    if len(p.handle) != HANDLE_BYTES:
        raise ValueError(f"a {len(p.handle)}-byte IPC handle (a PLACED answer carries {HANDLE_BYTES})")
    body = [_string(header.dtype), _U32.pack(header.row_width), _string(header.layout),
            _U32.pack(len(header.segments))]
    for s, offset in zip(header.segments, p.offsets):
        k = index.get((s.id, s.position - s.row_start))
        if k is None:
            raise ChannelError(f"a segment of {s.id!r:.80} at {s.position - s.row_start}, no item of the fetch")
        body.append(_SEGMENT.pack(k, s.row_start, s.row_end, offset))
    body += [_string(p.kind), p.handle, _string(p.generation), _PLACED_TAIL.pack(p.size),
             b"\x01" + bytes.fromhex(p.token) if p.token is not None else b"\x00", _LEASE.pack(p.lease_s)]
    return frame(PLACED, request_id, b"".join(body))


def unplaced(request_id: int, answer: IpcUnavailable) -> bytes:
    return frame(UNPLACED, request_id, _string(answer.reason[:4000]) + _string(answer.owner or ""))


def error(request_id: int, kind: str, message: str) -> bytes:
    return frame(ERROR, request_id, _string(kind) + _string(message[:4000]))


def read_placed(body: bytes, items) -> tuple[WireHeader, IpcPlacement]:
    """The wire header and placement of a PLACED body answering a fetch of `items`."""
    r = Reader(body)
    dtype, (row_width,), layout, (n,) = r.string(), r.unpack(_U32), r.string(), r.unpack(_U32)
    segments, offsets = [], []
    for _ in range(n):
        k, row_start, row_end, offset = r.unpack(_SEGMENT)
        if k >= len(items) or row_end <= row_start:
            raise ChannelError(f"a segment of item {k} (rows {row_start}..{row_end}) in a fetch of {len(items)}")
        item_id, at = items[k]
        segments.append(Segment(item_id, at + row_start, row_start, row_end))
        offsets.append(offset)
    kind, handle, generation, (size,) = r.string(), bytes(r.take(HANDLE_BYTES)), r.string(), r.unpack(_PLACED_TAIL)
    token = bytes(r.take(16)).hex() if r.take(1)[0] else None
    (lease_s,) = r.unpack(_LEASE)
    r.end()
    return (WireHeader(dtype, row_width, layout, tuple(segments)),
            IpcPlacement(kind, handle, generation, size, tuple(offsets), token, lease_s))


def read_unplaced(body: bytes) -> IpcUnavailable:
    r = Reader(body)
    reason, owner = r.string(), r.string()
    r.end()
    return IpcUnavailable(reason, owner or None)


def read_error(body: bytes) -> tuple[str, str]:
    r = Reader(body)
    kind, message = r.string(), r.string()
    r.end()
    return kind, message
