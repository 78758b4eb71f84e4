"""The fetch payload on the wire, shared by HTTP, gRPC and the client. No pickle, no numpy bf16.

payload = header (JSON: version, dtype, row_width, layout, num_rows, segments) + the rows' raw
little-endian bytes, row-major, in segment order (segment k's rows follow segment k-1's).

- HTTP `application/octet-stream`: u32 LE header length | header JSON | rows.
- HTTP `application/safetensors`: a safetensors file with one tensor "rows" and the header JSON in its
  metadata under "header" (any safetensors reader can open it).
- gRPC: a FetchChunk with the header, then FetchChunks of row bytes, each message <= 1 MiB.

Decoding writes each segment's bytes straight into a caller-given buffer (`out`, the LLM's
input-embeddings rows for the chunk: row `position - start`) when it is a contiguous CPU tensor of the
payload's dtype; otherwise the rows are staged once on the CPU and copied (casting) into `out`.
"""

from __future__ import annotations

import itertools
import json
import struct
import sys
from dataclasses import dataclass
from typing import Iterator

import torch

from encoder_service.errors import InvalidInput
from encoder_service.protocol.dtypes import DTYPES, UnsupportedDtype, dtype_name
from encoder_service.ranges import Segment

VERSION = 1
# Largest row-data piece of one gRPC message: 1 MiB less room for the field tag, length and oneof.
GRPC_MESSAGE_BYTES = 1 << 20
GRPC_DATA_BYTES = GRPC_MESSAGE_BYTES - 64
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


def encode_http(header: WireHeader, rows: torch.Tensor) -> bytes:
    head = header.to_json()
    return b"".join((_U32.pack(len(head)), head, row_bytes(rows)))


def decode_http(body: bytes | memoryview, out: torch.Tensor | None = None, start: int = 0):
    """(header, rows) from an octet-stream body; with `out`, rows is `out` with the segments written in."""
    head, data = _split_header(body, _U32, "fetch payload")
    header = WireHeader.from_json(head)
    return header, _decode_rows(header, data, out, start)


def encode_safetensors(header: WireHeader, rows: torch.Tensor) -> bytes:
    data = row_bytes(rows)
    meta = {"rows": {"dtype": _SAFETENSORS_DTYPES[header.dtype], "shape": [header.num_rows, header.row_width],
                     "data_offsets": [0, len(data)]},
            "__metadata__": {"header": header.to_json().decode()}}
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data start to 8 bytes
    return b"".join((_U64.pack(len(head)), head, data))


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


def _decode_rows(header: WireHeader, data: memoryview, out: torch.Tensor | None, start: int) -> torch.Tensor:
    writer = RowWriter(header, out, start)
    writer.write(data)
    return writer.finish()


class RowWriter:
    """Receives a payload's row bytes in pieces of any size and puts each segment's rows in place.

    Without `out`: rows land in a new [num_rows, row_width] tensor, segment after segment.
    With `out` ([>= end - start, row_width]): segment rows land at out[position - start].
    """

    def __init__(self, header: WireHeader, out: torch.Tensor | None = None, start: int = 0):
        self.header, self._out, self._start = header, out, start
        dtype = DTYPES[header.dtype]
        if out is not None:
            check_out(header, out, start)
        direct = out is not None and out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
        # Bytes go into `dest`; `targets` are (first dest row, num rows) per segment, in payload order.
        if direct:
            self._dest = out
            self._targets = [(s.position - start, s.num_rows) for s in header.segments]
        else:
            self._dest = torch.empty(header.num_rows, header.row_width, dtype=dtype)
            sizes = [s.num_rows for s in header.segments]
            self._targets = list(zip(itertools.accumulate(sizes, initial=0), sizes))
        self._bytes = self._dest.detach().view(-1).view(torch.uint8).numpy() if self._dest.numel() else None
        self._row_bytes = header.row_bytes
        self._span, self._span_done, self._received = 0, 0, 0  # current target span, bytes into it, total

    def write(self, piece: bytes | memoryview) -> None:
        piece = memoryview(piece).cast("B")
        if self._received + len(piece) > self.header.payload_bytes:
            raise WireError(f"fetch payload has more than the {self.header.payload_bytes} row bytes its header "
                            f"announces ({self.header.num_rows} rows x {self._row_bytes} bytes)")
        self._received += len(piece)
        while len(piece):
            row0, num_rows = self._targets[self._span]
            span_bytes = num_rows * self._row_bytes
            n = min(len(piece), span_bytes - self._span_done)
            lo = row0 * self._row_bytes + self._span_done
            self._bytes[lo:lo + n] = piece[:n]
            piece, self._span_done = piece[n:], self._span_done + n
            if self._span_done == span_bytes:
                self._span, self._span_done = self._span + 1, 0

    def finish(self) -> torch.Tensor:
        if self._received != self.header.payload_bytes:
            raise WireError(f"fetch payload is short: {self._received} of {self.header.payload_bytes} row bytes")
        if self._out is None or self._dest is self._out:
            return self._dest
        # Staged (GPU, other dtype, or strided `out`): one copy per segment, casting as needed.
        return place_rows(self.header, self._dest, self._out, self._start)


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
