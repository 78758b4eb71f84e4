"""The fetch payload on the wire, shared by HTTP, gRPC and the client. No pickle, no numpy bf16.

payload = header (JSON: version, dtype, row_width, layout, num_rows, segments) + the rows' raw
little-endian bytes, row-major, in segment order (segment k's rows follow segment k-1's).

- HTTP `application/octet-stream`: u32 LE header length | header JSON | rows.
- HTTP `application/safetensors`: a safetensors file with one tensor "rows" and the header JSON in its
  metadata under "header" (any safetensors reader can open it).
- gRPC: a FetchChunk with the header, then FetchChunks of row bytes, each message <= 1 MiB unless the
  client accepts larger ones (FetchRequest.max_message_bytes); the server frames them itself
  (`grpc_data_message`: no protobuf copy of the bytes).

Senders take (prefix, rows memoryview) pairs (`http_parts`, `safetensors_parts`): the rows leave the cache
entry's buffer without being joined to anything. Receivers read into `RowWriter.spans()`: each segment's
bytes land straight in a caller-given buffer (`out`, the LLM's input-embeddings rows for the chunk: row
`position - start`) when it is a contiguous CPU tensor of the payload's dtype; otherwise they are staged once
on the CPU (a caller-given, e.g. pinned, `staging` buffer or a new tensor) and copied (casting, to any
device) into `out`. Without `out` the packed rows (in `staging` or a new tensor) are the answer.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from encoder_service.errors import InvalidInput
from encoder_service.protocol.dtypes import DTYPES, UnsupportedDtype, dtype_name
from encoder_service.ranges import Segment

VERSION = 1
# Largest row-data piece of one gRPC message: 1 MiB less room for the field tag, length and oneof.
GRPC_MESSAGE_BYTES = 1 << 20
GRPC_FRAMING_BYTES = 64
GRPC_DATA_BYTES = GRPC_MESSAGE_BYTES - GRPC_FRAMING_BYTES
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MAX_HEADER_BYTES = 64 << 20  # a header this big is corrupt, not a long segment list

# Raw bytes are copied to and from tensors as they sit in memory: the wire is little-endian.
if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("encoder_service.protocol.wire assumes a little-endian host")


class WireError(InvalidInput):
    """A payload that can't be decoded: short, corrupt, or not matching the caller's buffer."""


@dataclass(frozen=True)
class WireHeader:
    dtype: str
    row_width: int
    layout: str
    segments: tuple[Segment, ...]
    version: int = VERSION

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.segments)

    @property
    def row_bytes(self) -> int:
        return self.row_width * DTYPES[self.dtype].itemsize

    @property
    def payload_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    @classmethod
    def of(cls, segments, rows: torch.Tensor, layout: str) -> WireHeader:
        """The header for `rows` [sum rows, row_width] cut into `segments` (a core FetchResult's parts);
        ValueError when the rows are not the segments' rows (a server bug, never sent)."""
        header = cls(dtype_name(rows.dtype), int(rows.shape[1]), layout,
                     tuple(Segment(s.id, s.position, s.row_start, s.row_end) for s in segments))
        if rows.dim() != 2 or rows.shape[0] != header.num_rows:
            raise ValueError(f"rows {tuple(rows.shape)} do not match segments ({header.num_rows} rows)")
        return header

    @classmethod
    def of_fetch(cls, result) -> WireHeader:
        """The header of a core fetch answer (`segments`, `rows`, `dtype`, `row_width`, `layout`): with rows,
        `of` (checked against the segments); rows written to shared memory instead: from the fields alone."""
        if result.rows is not None:
            return cls.of(result.segments, result.rows, result.layout)
        return cls(result.dtype, result.row_width, result.layout, tuple(result.segments))

    def to_dict(self) -> dict:
        return {"version": self.version, "dtype": self.dtype, "row_width": self.row_width,
                "layout": self.layout, "num_rows": self.num_rows,
                "segments": [[s.id, s.position, s.row_start, s.row_end] for s in self.segments]}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d) -> WireHeader:
        try:
            if d["version"] != VERSION:
                raise WireError(f"payload version {d['version']!r}, this client reads version {VERSION}")
            segments = tuple(Segment(str(i), int(p), int(a), int(b)) for i, p, a, b in d["segments"])
            header = cls(dtype_name(d["dtype"]), int(d["row_width"]), str(d["layout"]), segments)
            num_rows = int(d["num_rows"])
        except UnsupportedDtype as exc:
            raise WireError(exc.message) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"malformed fetch header: {exc!r}") from exc
        if header.row_width <= 0 or any(s.num_rows <= 0 or s.row_start < 0 or s.position < 0 for s in segments):
            raise WireError(f"malformed fetch header: bad row_width or segment in {d!r:.200}")
        if num_rows != header.num_rows:
            raise WireError(f"fetch header says num_rows={num_rows} but its segments hold {header.num_rows}")
        return header

    @classmethod
    def from_json(cls, data: bytes | memoryview) -> WireHeader:
        try:
            d = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WireError(f"fetch header is not JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise WireError("fetch header is not a JSON object")
        return cls.from_dict(d)


def row_bytes(rows: torch.Tensor) -> memoryview:
    """The raw bytes of CPU `rows` (no copy when contiguous). bf16 goes through a uint8 view."""
    rows = rows.detach()
    if rows.device.type != "cpu":
        rows = rows.cpu()
    flat = rows.contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def rows_from_bytes(data: bytes | memoryview, dtype: str, row_width: int, num_rows: int) -> torch.Tensor:
    """A new [num_rows, row_width] tensor from raw little-endian bytes (length checked; one copy)."""
    writer = RowWriter(WireHeader(dtype_name(dtype), row_width, "", (Segment("", 0, 0, num_rows),)))
    writer.write(data)
    return writer.finish()


def http_parts(header: WireHeader, rows: torch.Tensor) -> tuple[bytes, memoryview]:
    """The octet-stream payload as (u32 header length | header JSON, the rows' bytes: no copy)."""
    head = header.to_json()
    return _U32.pack(len(head)) + head, row_bytes(rows)


def read_http_header(read: Callable[[int], bytes], body_bytes: int) -> WireHeader:
    """The header of an octet-stream body of `body_bytes` bytes, read with `read(n)` (exactly n bytes; the
    rows stay unread). WireError unless the rest of the body is exactly the rows the header announces."""
    if body_bytes < _U32.size:
        raise WireError(f"fetch payload is {body_bytes} bytes, shorter than its {_U32.size}-byte header length")
    (head_len,) = _U32.unpack(read(_U32.size))
    if head_len > min(_MAX_HEADER_BYTES, body_bytes - _U32.size):
        raise WireError(f"fetch payload: header length {head_len} exceeds the {body_bytes}-byte payload")
    header = WireHeader.from_json(read(head_len))
    rows = body_bytes - _U32.size - head_len
    if rows != header.payload_bytes:
        raise WireError(f"fetch payload has {rows} row bytes, its header announces {header.payload_bytes} "
                        f"({header.num_rows} rows x {header.row_bytes} bytes)")
    return header


def split_http(body: bytes | memoryview) -> tuple[WireHeader, memoryview]:
    """(header, row bytes: a view) of a whole octet-stream body."""
    head, data = _split_header(body, _U32, "fetch payload")
    return WireHeader.from_json(head), data


def decode_http(body: bytes | memoryview, out: torch.Tensor | None = None, start: int = 0):
    """(header, rows) from an octet-stream body; with `out`, rows is `out` with the segments written in."""
    header, data = split_http(body)
    return header, _decode_rows(header, data, out, start)


def safetensors_parts(header: WireHeader, rows: torch.Tensor) -> tuple[bytes, memoryview]:
    """The safetensors payload as (its header, the rows' bytes: no copy)."""
    data = row_bytes(rows)
    meta = {"rows": {"dtype": _SAFETENSORS_DTYPES[header.dtype], "shape": [header.num_rows, header.row_width],
                     "data_offsets": [0, len(data)]},
            "__metadata__": {"header": header.to_json().decode()}}
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data start to 8 bytes
    return _U64.pack(len(head)) + head, data


def decode_safetensors(body: bytes | memoryview, out: torch.Tensor | None = None, start: int = 0):
    """Like decode_http, for the safetensors variant (parsed here so rows go straight into `out`)."""
    head, data = _split_header(body, _U64, "safetensors payload")
    try:
        meta = json.loads(bytes(head))
        header = WireHeader.from_json(meta["__metadata__"]["header"].encode())
        lo, hi = meta["rows"]["data_offsets"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise WireError(f"not an encoder_service safetensors payload: {exc!r}") from exc
    return header, _decode_rows(header, data[lo:hi], out, start)


def _split_header(body: bytes | memoryview, length: struct.Struct, what: str) -> tuple[memoryview, memoryview]:
    """(header bytes, the rest) of `body` = little-endian header length | header | rest."""
    body = memoryview(body).cast("B")
    if len(body) < length.size:
        raise WireError(f"{what} is {len(body)} bytes, shorter than its {length.size}-byte header length")
    (head_len,) = length.unpack_from(body)
    if head_len > min(_MAX_HEADER_BYTES, len(body) - length.size):
        raise WireError(f"{what}: header length {head_len} exceeds the {len(body)}-byte payload")
    return body[length.size:length.size + head_len], body[length.size + head_len:]


def grpc_data_chunks(rows: torch.Tensor, max_bytes: int = GRPC_DATA_BYTES) -> Iterator[memoryview]:
    """Row bytes in pieces of at most `max_bytes` (views: the caller copies each into its message)."""
    data = row_bytes(rows)
    for lo in range(0, len(data), max_bytes):
        yield data[lo:lo + max_bytes]


def grpc_data_message(piece: memoryview) -> bytes:
    """The serialized FetchChunk{data: piece}, framed here (field 2, length-delimited): one copy of the bytes,
    where bytes(piece), the message and its serialization made three."""
    return b"".join((_FETCH_CHUNK_DATA_TAG, _varint(len(piece)), piece))


def grpc_data_view(message: bytes) -> memoryview | None:
    """The row bytes of a serialized FetchChunk that is exactly one `data` field (a view: no copy), else None
    (a header, or framing this reader does not expect: parse those with protobuf)."""
    if not message or message[0] != _FETCH_CHUNK_DATA_TAG[0]:
        return None
    length, shift, i = 0, 0, 1
    while i < len(message) and shift < 64:
        byte = message[i]
        length |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return memoryview(message)[i:] if i + length == len(message) else None
    return None


_FETCH_CHUNK_DATA_TAG = bytes([(2 << 3) | 2])  # FetchChunk field 2 (`data`), wire type 2 (length-delimited)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _decode_rows(header: WireHeader, data: memoryview, out: torch.Tensor | None, start: int) -> torch.Tensor:
    writer = RowWriter(header, out, start)
    writer.write(data)
    return writer.finish()


class RowWriter:
    """Receives a payload's row bytes and puts each segment's rows in place: pushed in pieces of any size
    (`write`), or read straight into place (`readinto`: a socket's recv_into, no intermediate bytes).

    With `out` ([>= end - start, row_width]): segment rows land at out[position - start]; directly when `out`
    is a contiguous CPU tensor of the payload's dtype, else packed in `staging` (a uint8 CPU tensor of
    >= payload_bytes, e.g. pinned memory for a CUDA `out`: then one host-to-device copy per segment) or a new
    tensor, and copied (casting) by `finish`.
    Without `out`: rows land packed, segment after segment, in `staging` or a new tensor, and that
    [num_rows, row_width] view is the answer: the caller's to keep, so `staging` must be memory nobody
    reuses while the answer lives (client/destination.py: memory of the client's HostRowPool).
    """

    def __init__(self, header: WireHeader, out: torch.Tensor | None = None, start: int = 0,
                 staging: torch.Tensor | None = None):
        self.header, self._out, self._start = header, out, start
        dtype = DTYPES[header.dtype]
        if out is not None:
            check_out(header, out, start)
        if out is not None and is_direct(out, dtype):
            self._dest = out
            targets = [(s.position - start, s.num_rows) for s in header.segments]
        else:
            if staging is not None:
                if staging.numel() < header.payload_bytes:
                    raise ValueError(f"staging buffer of {staging.numel()} bytes for {header.payload_bytes} row bytes")
                self._dest = staging[:header.payload_bytes].view(dtype).view(header.num_rows, header.row_width)
            else:
                self._dest = torch.empty(header.num_rows, header.row_width, dtype=dtype)
            targets = [(0, header.num_rows)]  # packed: one span
        flat = self._dest.detach().view(-1).view(torch.uint8).numpy() if self._dest.numel() else None
        rb = header.row_bytes
        # Where the payload's bytes go, in payload order: a writable view per target span (empty ones dropped).
        self._spans = [memoryview(flat[row0 * rb:(row0 + n) * rb]) for row0, n in targets if n]
        self._span, self._span_done, self._received = 0, 0, 0  # current span, bytes into it, total

    def write(self, piece: bytes | memoryview) -> None:
        piece = memoryview(piece).cast("B")
        if len(piece) > self.remaining:
            raise WireError(f"fetch payload has more than the {self.header.payload_bytes} row bytes its header "
                            f"announces ({self.header.num_rows} rows x {self.header.row_bytes} bytes)")
        while len(piece):
            view = self.next_view()
            n = min(len(piece), len(view))
            view[:n] = piece[:n]
            piece = piece[n:]
            self.advance(n)

    def readinto(self, recv_into: Callable[[memoryview], int]) -> None:
        """Reads the rest of the rows with `recv_into(view) -> bytes read` straight into their places (one
        call per socket read, views of the destination: nothing else is allocated); WireError when it
        returns 0 (the sender stopped short)."""
        while self.remaining:
            self.advance(recv_into(self.next_view()))

    @property
    def remaining(self) -> int:
        """Row bytes still to come."""
        return self.header.payload_bytes - self._received

    def next_view(self) -> memoryview:
        """Where the next row bytes go (the rest of the current span; call only while `remaining`)."""
        return self._spans[self._span][self._span_done:]

    def advance(self, n: int) -> None:
        """`n` bytes were put into next_view() (0: the sender stopped short, a WireError)."""
        if not n:
            raise WireError(f"fetch payload is short: {self._received} of {self.header.payload_bytes} row bytes")
        self._received += n
        self._span_done += n
        if self._span_done == len(self._spans[self._span]):
            self._span, self._span_done = self._span + 1, 0

    def finish(self) -> torch.Tensor:
        if self._received != self.header.payload_bytes:
            raise WireError(f"fetch payload is short: {self._received} of {self.header.payload_bytes} row bytes")
        if self._out is None or self._dest is self._out:
            return self._dest
        # Staged (GPU, other dtype, or strided `out`): one copy per segment, casting as needed.
        return place_rows(self.header, self._dest, self._out, self._start)


def is_direct(out: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether payload bytes of `dtype` can be written straight into `out`'s memory."""
    return out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()


def place_rows(header: WireHeader, rows: torch.Tensor, out: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Packed `rows` [num_rows, row_width] (segment order) into `out` at row position - start, one copy per
    segment (casting, to any device); returns `out`. Raises WireError when `out` can't hold them."""
    check_out(header, out, start)
    done = 0
    for s in header.segments:
        out[s.position - start:s.position - start + s.num_rows].copy_(rows[done:done + s.num_rows])
        done += s.num_rows
    return out


def check_out(header: WireHeader, out: torch.Tensor, start: int) -> None:
    """WireError unless `out` [rows, row_width] holds every segment at row position - start."""
    if out.dim() != 2 or out.shape[1] != header.row_width:
        raise WireError(f"out must be [rows, {header.row_width}] for this payload, got {tuple(out.shape)}")
    need = max((s.position + s.num_rows - start for s in header.segments), default=0)
    low = min((s.position - start for s in header.segments), default=0)
    if low < 0 or need > out.shape[0]:
        raise WireError(f"out has {out.shape[0]} rows; the segments need rows [{low}, {need}) (start={start})")
