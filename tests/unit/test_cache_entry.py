"""Entry format: owned rows, header, byte offsets of row ranges, verification."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from encoder_service.cache.entry import (
    HEADER_LEN,
    CorruptEntry,
    Entry,
    EntryHeader,
    rows_from_blocks,
)
from encoder_service.errors import InvalidInput

# (num_rows, out_hidden, num_deepstack): small stand-ins for Qwen2.5 'main' and Qwen3 deepstack rows.
SHAPES = [(150, 96, 0), (90, 64, 3)]


def make_rows(num_rows, out_hidden, num_deepstack, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    levels = [torch.randn(num_rows, out_hidden, generator=g) + 10 * k for k in range(1 + num_deepstack)]
    return torch.cat(levels, dim=1).to(dtype)  # [main | ds1 | ds2 | ds3]


def layout(num_deepstack):
    return "main" if num_deepstack == 0 else f"main+deepstack{num_deepstack}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_and_byte_offsets(shape, dtype):
    rows = make_rows(*shape, dtype)
    entry = Entry.from_rows(rows, (1, 10, 60), layout(shape[2]))
    data = entry.to_bytes("k1")
    back = Entry.from_bytes(data, "k1")
    assert torch.equal(back.tensor, rows) and back.tensor.dtype == dtype
    h = back.header
    assert (h.num_rows, h.row_width, h.grid_thw, h.layout) == (shape[0], rows.shape[1], (1, 10, 60), layout(shape[2]))
    # Rows [a, b) are exactly the bytes header_len + a*row_bytes .. header_len + b*row_bytes - 1.
    a, b = 7, 41
    raw = data[HEADER_LEN + a * h.row_bytes : HEADER_LEN + b * h.row_bytes]
    assert raw == entry.rows(a, b).view(torch.uint8).numpy().tobytes()
    assert raw == rows[a:b].contiguous().view(torch.uint8).numpy().tobytes()  # raw little-endian values


def test_from_rows_copies_out_of_the_batch():
    batch = torch.randn(10, 8)
    entry = Entry.from_rows(batch[2:5], (1, 2, 6), "main")
    batch.zero_()  # e.g. a CUDA-graph static buffer reused by the next batch
    assert entry.tensor.abs().sum() > 0
    assert entry.tensor.untyped_storage().nbytes() == 3 * 8 * 4  # its own storage, not the batch's
    assert entry.tensor.is_contiguous()


def test_from_rows_without_copy_takes_owned_host_rows():
    rows = torch.randn(6, 8).bfloat16()
    entry = Entry.from_rows(rows, (1, 2, 12), "main", copy=False)
    assert entry.tensor.data_ptr() == rows.data_ptr()  # the engine's rows are not copied a second time
    assert torch.equal(Entry.from_bytes(entry.to_bytes()).tensor, rows)


def test_rows_are_views_of_the_right_rows_and_ranges_are_checked():
    rows = make_rows(20, 16, 3, torch.bfloat16)
    entry = Entry.from_rows(rows, (1, 4, 20), "main+deepstack3")
    assert torch.equal(entry.rows(3, 9), rows[3:9])
    assert torch.equal(entry.rows(3, 9)[:, 16:32], rows[3:9, 16:32])  # deepstack level 1 of those rows
    for start, end in [(0, 21), (-1, 3), (5, 5), (9, 3)]:
        with pytest.raises(InvalidInput):
            entry.rows(start, end)


@pytest.mark.parametrize("shape", SHAPES)
def test_block_range_decode_equals_slices(shape):
    rows = make_rows(*shape, torch.bfloat16)
    entry = Entry.from_rows(rows, (1, 2, 2 * shape[0]), layout(shape[2]), block_bytes=4096)
    data = entry.to_bytes("k")
    h = EntryHeader.parse(data, "k")
    assert h.num_blocks > 2  # the test must cross block boundaries
    trailer = data[h.trailer_offset :]
    for start, end in [(0, 1), (0, h.num_rows), (h.block_rows - 1, h.block_rows + 1), (5, h.num_rows - 3)]:
        lo, hi = h.block_bytes_range(*h.block_span(start, end))
        assert torch.equal(rows_from_blocks(h, trailer, start, end, data[lo:hi]), rows[start:end])


def corruptions(data: bytes):
    yield "truncated", data[:-1]
    yield "short", data[:HEADER_LEN - 1]
    yield "empty", b""
    yield "extended", data + b"\0"
    yield "foreign", b"not an embedding entry at all" * 10
    flipped = bytearray(data)
    flipped[HEADER_LEN + 100] ^= 0x01
    yield "payload bit", bytes(flipped)
    flipped = bytearray(data)
    flipped[10] ^= 0x01
    yield "header bit", bytes(flipped)
    flipped = bytearray(data)
    flipped[-1] ^= 0x01
    yield "trailer bit", bytes(flipped)


def test_corrupt_short_and_foreign_values_raise():
    entry = Entry.from_rows(make_rows(64, 32, 0, torch.float32), (1, 8, 32), "main")
    data = entry.to_bytes("key-a")
    for name, bad in corruptions(data):
        with pytest.raises(CorruptEntry):
            Entry.from_bytes(bad, "key-a")
            pytest.fail(f"{name} value was accepted")
    with pytest.raises(CorruptEntry, match="another key"):
        Entry.from_bytes(data, "key-b")  # a valid entry under the wrong key


def test_corrupt_block_fails_range_verification():
    rows = make_rows(200, 64, 0, torch.bfloat16)
    data = bytearray(Entry.from_rows(rows, (1, 20, 40), "main", block_bytes=4096).to_bytes())
    h = EntryHeader.parse(bytes(data))
    data[HEADER_LEN + 3 * h.row_bytes] ^= 0xFF  # row 3, block 0
    data = bytes(data)
    trailer = data[h.trailer_offset :]
    lo, hi = h.block_bytes_range(*h.block_span(0, 4))
    with pytest.raises(CorruptEntry, match="block 0"):
        rows_from_blocks(h, trailer, 0, 4, data[lo:hi])
    # Rows in other blocks still verify (and are served).
    start = h.block_rows
    lo, hi = h.block_bytes_range(*h.block_span(start, start + 5))
    assert torch.equal(rows_from_blocks(h, trailer, start, start + 5, data[lo:hi]), rows[start : start + 5])


def test_bad_inputs_to_from_rows():
    with pytest.raises(InvalidInput):
        Entry.from_rows(torch.zeros(0, 4), (1, 1, 1), "main")
    with pytest.raises(InvalidInput):
        Entry.from_rows(torch.zeros(4, 4, dtype=torch.int32), (1, 1, 1), "main")
    with pytest.raises(InvalidInput):
        Entry.from_rows(torch.zeros(4, 4), (1, 1, 1), "x" * 40)


def test_the_content_tag_travels_and_version_1_values_still_read():
    rows = make_rows(40, 64, 0, torch.float32)
    entry = Entry.from_rows(rows, (1, 8, 20), "main", content_tag=0xABCDEF0123)
    data = entry.to_bytes("k")
    back = Entry.from_bytes(data, "k")
    assert back.header.content_tag == 0xABCDEF0123 and torch.equal(back.tensor, rows)
    # A value written before the tag existed (version 1): the same 88-byte header with a 32-byte layout
    # field and no tag. It still reads, as "not recorded" (0).
    h = back.header
    fields = struct.Struct("<4sHBBIIIIII32sQQ").pack(b"ESEM", 1, 3, 1, h.num_rows, h.row_width, h.block_rows,
                                                    *h.grid_thw, b"main", h.key_tag, h.payload_digest)
    old = Entry.from_bytes(fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields)) + data[HEADER_LEN:], "k")
    assert old.header.content_tag == 0 and old.header.layout == "main" and torch.equal(old.tensor, rows)
