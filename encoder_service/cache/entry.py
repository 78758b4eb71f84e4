"""One cached embedding: a versioned fixed-size header, the row-major payload, a block-checksum trailer.

Serialized value (all integers little-endian, no pickle):

    [ header: HEADER_LEN bytes | payload: num_rows * row_bytes | trailer: 8 bytes per block ]

  - payload: the rows, row-major, raw little-endian values (bf16 as its 2-byte pattern). Qwen3 rows are
    [main | ds1 | ds2 | ds3], so rows [a, b) are the bytes HEADER_LEN + a*row_bytes .. HEADER_LEN + b*row_bytes - 1
    and Redis GETRANGE can read a chunk's rows without the rest.
  - trailer: xxh3_64 of each block of `block_rows` rows (about BLOCK_TARGET_BYTES each).
  - header: magic, version, dtype, num_rows, row_width, block_rows, grid_thw, layout, `content_tag` (of the
    image bytes a caller id was encoded from, keys.py: content_tag; 0 for content-hash keys, which are their
    content: so that every replica reading the entry can tell when an id is sent with other bytes), `key_tag`
    (xxh3_64 of the key the value was written under, so a valid entry stored under the wrong key reads as foreign),
    `payload_digest` (xxh3_64 of the trailer: a checksum of the payload through its block checksums) and
    `header_digest` (xxh3_64 of the header bytes before it).

Why blocks: a range read cannot check a whole-payload checksum without reading the whole payload, which
is what range reads exist to avoid. With block checksums a range read fetches the header, the (small)
trailer and the blocks covering its rows, and verifies every byte it serves: header digest -> trailer
digest -> block checksums. The cost is reading up to two partial blocks beyond the range (< 2 x 64 KiB)
and 8 bytes of trailer per block (about 8 KiB for a 67 MB Qwen3 entry). A whole read (`from_bytes`)
verifies the same chain plus the exact length.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
import warnings
from dataclasses import dataclass

import torch
import xxhash

from encoder_service.errors import EncoderServiceError, InvalidInput

assert sys.byteorder == "little", "entries store raw little-endian values; big-endian hosts need a byteswap"

# torch warns (once) that a tensor made from an immutable `bytes` is writable. Entries decoded from Redis
# view the received bytes without a copy and are read-only by contract, so silence it for this module only.
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=__name__
)

MAGIC = b"ESEM"
VERSION = 2  # 1: no content_tag, a 32-byte layout (read still, as content_tag 0)
CHECKSUM_XXH3_64 = 1
BLOCK_TARGET_BYTES = 64 * 1024
LAYOUT_BYTES = 24

DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

# magic, version, dtype, checksum algo, num_rows, row_width, block_rows, t, h, w, layout, content_tag, key_tag,
# payload_digest
_FIELDS = struct.Struct("<4sHBBIIIIII24sQQQ")
_FIELDS_V1 = struct.Struct("<4sHBBIIIIII32sQQ")  # the same 80 bytes: version 2 took 8 of the layout's 32
_DIGEST = struct.Struct("<Q")
HEADER_LEN = _FIELDS.size + _DIGEST.size  # 88
assert _FIELDS_V1.size == _FIELDS.size


class CorruptEntry(EncoderServiceError):
    """A stored value that is short, corrupt, of another format, or written under another key.

    The store treats it as a miss: such a value is never served.
    """

    kind = "internal"


def key_tag(key: str | None) -> int:
    return xxhash.xxh3_64_intdigest(key.encode()) if key else 0


@dataclass(frozen=True)
class EntryHeader:
    dtype: torch.dtype
    num_rows: int
    row_width: int
    block_rows: int
    grid_thw: tuple[int, int, int]
    layout: str
    key_tag: int = 0
    payload_digest: int = 0
    content_tag: int = 0  # of a caller id's image bytes; 0: not recorded (a content-hash key is its content)

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.dtype.itemsize

    @property
    def payload_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.block_rows)

    @property
    def trailer_offset(self) -> int:
        return HEADER_LEN + self.payload_bytes

    @property
    def total_len(self) -> int:
        return self.trailer_offset + 8 * self.num_blocks

    def block_span(self, start: int, end: int) -> tuple[int, int]:
        """Blocks [first, last) covering rows [start, end)."""
        return start // self.block_rows, -(-end // self.block_rows)

    def block_bytes_range(self, first: int, last: int) -> tuple[int, int]:
        """Byte range [lo, hi) of blocks [first, last) inside the serialized value."""
        lo = HEADER_LEN + first * self.block_rows * self.row_bytes
        hi = HEADER_LEN + min(last * self.block_rows, self.num_rows) * self.row_bytes
        return lo, hi

    def check_rows(self, start: int, end: int) -> None:
        if not (0 <= start < end <= self.num_rows):
            raise InvalidInput(f"row range [{start}, {end}) is outside the entry's {self.num_rows} rows")

    def pack(self) -> bytes:
        layout = self.layout.encode("ascii")
        fields = _FIELDS.pack(
            MAGIC, VERSION, DTYPE_CODES[self.dtype], CHECKSUM_XXH3_64, self.num_rows, self.row_width,
            self.block_rows, *self.grid_thw, layout, self.content_tag, self.key_tag, self.payload_digest,
        )  # fmt: skip
        return fields + _DIGEST.pack(xxhash.xxh3_64_intdigest(fields))

    @classmethod
    def parse(cls, buf: bytes | memoryview, key: str | None = None) -> EntryHeader:
        """Parse and verify a header; CorruptEntry if short, foreign, corrupt or under another key."""
        if len(buf) < HEADER_LEN:
            raise CorruptEntry(f"value is {len(buf)} bytes, shorter than the {HEADER_LEN}-byte header")
        fields = bytes(buf[: _FIELDS.size])
        magic, version = struct.unpack_from("<4sH", fields)
        if magic != MAGIC:
            raise CorruptEntry(f"foreign value: magic {magic!r}, expected {MAGIC!r}")
        (stored,) = _DIGEST.unpack(bytes(buf[_FIELDS.size : HEADER_LEN]))
        if stored != xxhash.xxh3_64_intdigest(fields):
            raise CorruptEntry("header checksum mismatch")
        if version == 1:
            (_, _, dtype_code, algo, num_rows, row_width, block_rows, t, h, w, layout, tag,
             payload_digest) = _FIELDS_V1.unpack(fields)  # fmt: skip
            content = 0
        else:
            (_, _, dtype_code, algo, num_rows, row_width, block_rows, t, h, w, layout, content, tag,
             payload_digest) = _FIELDS.unpack(fields)  # fmt: skip
        if version not in (1, VERSION) or algo != CHECKSUM_XXH3_64 or dtype_code not in CODE_DTYPES:
            raise CorruptEntry(f"unsupported entry: version {version}, checksum {algo}, dtype {dtype_code}")
        if num_rows == 0 or row_width == 0 or block_rows == 0:
            raise CorruptEntry("entry header has zero rows, width or block size")
        if key is not None and tag != key_tag(key):
            raise CorruptEntry(f"foreign value: written under another key than {key}")
        return cls(
            CODE_DTYPES[dtype_code], num_rows, row_width, block_rows, (t, h, w),
            layout.rstrip(b"\0").decode("ascii"), tag, payload_digest, content,
        )  # fmt: skip


def _block_sums(header: EntryHeader, payload: memoryview) -> bytes:
    """Trailer: xxh3_64 of each block of `block_rows` rows of the payload bytes."""
    step = header.block_rows * header.row_bytes
    return b"".join(
        _DIGEST.pack(xxhash.xxh3_64_intdigest(payload[i : i + step])) for i in range(0, len(payload), step)
    )


def verify_blocks(header: EntryHeader, trailer: bytes, first_block: int, blocks: memoryview) -> None:
    """Check a whole trailer against the header, then `blocks` (starting at `first_block`) against it."""
    if len(trailer) != 8 * header.num_blocks or xxhash.xxh3_64_intdigest(trailer) != header.payload_digest:
        raise CorruptEntry("block checksum trailer is short or does not match the header")
    step = header.block_rows * header.row_bytes
    for i, off in enumerate(range(0, len(blocks), step)):
        block = first_block + i
        (expected,) = _DIGEST.unpack_from(trailer, 8 * block)
        if xxhash.xxh3_64_intdigest(blocks[off : off + step]) != expected:
            raise CorruptEntry(f"payload block {block} checksum mismatch")


def _as_rows(buf, header: EntryHeader, offset: int, num_rows: int) -> torch.Tensor:
    """View `num_rows` rows of `buf` starting at byte `offset` as a [num_rows, row_width] tensor (no copy)."""
    flat = torch.frombuffer(buf, dtype=header.dtype, count=num_rows * header.row_width, offset=offset)
    return flat.view(num_rows, header.row_width)


class Entry:
    """One image's embedding rows: a CPU tensor [num_rows, row_width] the entry owns, plus its header.

    The tensor is read-only by contract (entries decoded from Redis view the received bytes).
    """

    __slots__ = ("header", "tensor", "_trailer")

    def __init__(self, header: EntryHeader, tensor: torch.Tensor, trailer: bytes | None = None):
        self.header = header
        self.tensor = tensor
        self._trailer = trailer

    @classmethod
    def from_rows(
        cls, rows: torch.Tensor, grid_thw, layout: str, *, block_bytes: int = BLOCK_TARGET_BYTES, copy: bool = True,
        content_tag: int = 0,
    ) -> Entry:
        """The entry of `rows` [num_tokens, row_width]. `block_bytes`: size of a checksummed block (rounded
        to whole rows; one row at least). `content_tag`: of the image bytes, for an entry under a caller id.

        Copies by default: a view into a batch output (or a CUDA-graph static buffer) would pin the whole
        batch in memory or change under us. A device tensor is copied to the host here (synchronizing).
        `copy=False` takes `rows` as they are when they are already an owned, contiguous host tensor (the
        engine's outputs: engine/engine.py EncodedImage), and copies otherwise.
        """
        if rows.dim() != 2 or rows.shape[0] == 0 or rows.dtype not in DTYPE_CODES:
            raise InvalidInput(
                f"entry rows must be a non-empty 2-D bf16/fp16/fp32 tensor, got {tuple(rows.shape)} {rows.dtype}"
            )
        if len(layout.encode("ascii")) > LAYOUT_BYTES:
            raise InvalidInput(f"layout name {layout!r} is longer than {LAYOUT_BYTES} bytes")
        tensor = rows.detach().to("cpu", copy=copy).contiguous()
        num_rows, row_width = tensor.shape
        row_bytes = row_width * tensor.dtype.itemsize
        header = EntryHeader(
            tensor.dtype, num_rows, row_width, max(1, block_bytes // row_bytes),
            tuple(int(x) for x in grid_thw), layout, content_tag=content_tag,
        )  # fmt: skip
        return cls(header, tensor)

    @property
    def nbytes(self) -> int:
        """Memory the entry holds (payload; header and trailer are negligible)."""
        return self.header.payload_bytes

    @property
    def num_rows(self) -> int:
        return self.header.num_rows

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as a [end - start, row_width] view of this entry (no copy; do not write)."""
        self.header.check_rows(start, end)
        return self.tensor[start:end]

    def block_sums(self) -> bytes:
        """The trailer: each block's checksum (computed once: one pass over the rows)."""
        if self._trailer is None:
            self._trailer = _block_sums(self.header, _payload_view(self.tensor))
        return self._trailer

    def stored_header(self, key: str | None = None) -> EntryHeader:
        """The header as stored: `key` (the full cache key) tagged into it when given, and the digest of the
        block checksums (`block_sums`)."""
        return dataclasses.replace(self.header, key_tag=key_tag(key),
                                   payload_digest=xxhash.xxh3_64_intdigest(self.block_sums()))

    def to_bytes(self, key: str | None = None) -> bytes:
        """Serialized value; `key` (the full cache key) is tagged into the header when given."""
        header = self.stored_header(key)
        return b"".join((header.pack(), _payload_view(self.tensor), self._trailer))

    @classmethod
    def from_bytes(cls, data: bytes, key: str | None = None) -> Entry:
        """Decode and verify a whole value (length, header, every block); CorruptEntry otherwise."""
        header = EntryHeader.parse(data, key)
        if len(data) != header.total_len:
            raise CorruptEntry(f"value is {len(data)} bytes, the header says {header.total_len}")
        view = memoryview(data)
        trailer = bytes(view[header.trailer_offset :])
        verify_blocks(header, trailer, 0, view[HEADER_LEN : header.trailer_offset])
        return cls(header, _as_rows(data, header, HEADER_LEN, header.num_rows), trailer)


def verify_rows(header: EntryHeader, trailer: bytes, first_block: int, rows: torch.Tensor) -> None:
    """Check `rows` (whole blocks from `first_block` on, the entry's last one may be short: [n, row_width],
    contiguous) against `trailer`, whose digest is the header's; CorruptEntry otherwise."""
    verify_blocks(header, trailer, first_block, _payload_view(rows))


def rows_from_blocks(header: EntryHeader, trailer: bytes, start: int, end: int, blocks: bytes) -> torch.Tensor:
    """Rows [start, end) out of the block-aligned bytes a range read fetched, verified first."""
    first, last = header.block_span(start, end)
    lo, hi = header.block_bytes_range(first, last)
    if len(blocks) != hi - lo:
        raise CorruptEntry(f"range read returned {len(blocks)} bytes, expected {hi - lo}")
    verify_blocks(header, trailer, first, memoryview(blocks))
    row0 = first * header.block_rows
    return _as_rows(blocks, header, (start - row0) * header.row_bytes, end - start)


def _payload_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
