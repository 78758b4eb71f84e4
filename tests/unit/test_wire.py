"""Fetch payload encoding: round trips, the caller's buffer, and clear errors on bad bytes."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from encoder_service.protocol import wire
from encoder_service.protocol.wire import RowWriter, WireError, WireHeader
from encoder_service.ranges import Segment, plan_chunk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (layout, row_width): Qwen2.5-style main rows and Qwen3-style [main | 3 deepstack levels].
LAYOUTS = [("main", 16), ("main+deepstack3", 4 * 16)]


def _payload(dtype, layout, row_width, start=3, end=17):
    """Two images: 'a' at positions [2, 8), 'b' at [10, 20); the rows of chunk [start, end)."""
    full = {"a": torch.randn(6, row_width).to(dtype), "b": torch.randn(10, row_width).to(dtype)}
    segments = plan_chunk([("a", 2, 6), ("b", 10, 10)], start, end)
    rows = torch.cat([full[s.id][s.row_start:s.row_end] for s in segments])
    return full, segments, rows, WireHeader.of(segments, rows, layout)


def _http_body(header, rows) -> bytes:
    prefix, data = wire.http_parts(header, rows)
    return prefix + bytes(data)


def _safetensors_body(header, rows) -> bytes:
    prefix, data = wire.safetensors_parts(header, rows)
    return prefix + bytes(data)


def _expected_chunk(full, segments, start, end, row_width, dtype):
    out = torch.zeros(end - start, row_width, dtype=dtype)
    for s in segments:
        out[s.position - start:s.position - start + s.num_rows] = full[s.id][s.row_start:s.row_end]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout, row_width", LAYOUTS)
def test_http_round_trip(dtype, layout, row_width):
    _, segments, rows, header = _payload(dtype, layout, row_width)
    got_header, got = wire.decode_http(_http_body(header, rows))
    assert got_header == header and got_header.layout == layout
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), rows.view(torch.uint8))  # bit-exact
    assert [s.id for s in got_header.segments] == ["a", "b"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout, row_width", LAYOUTS)
def test_safetensors_round_trip_and_interop(dtype, layout, row_width):
    _, _, rows, header = _payload(dtype, layout, row_width)
    body = _safetensors_body(header, rows)
    got_header, got = wire.decode_safetensors(body)
    assert got_header == header and torch.equal(got, rows)
    # Any safetensors reader opens it.
    assert torch.equal(safetensors.torch.load(body)["rows"], rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_buffer_gets_rows_at_their_positions(dtype):
    start, end, width = 3, 17, 16
    full, segments, rows, header = _payload(dtype, "main", width, start, end)
    out = torch.full((end - start, width), 7.0, dtype=dtype)
    ptr = out.data_ptr()
    _, got = wire.decode_http(_http_body(header, rows), out=out, start=start)
    assert got is out and out.data_ptr() == ptr  # written in place
    expected = _expected_chunk(full, segments, start, end, width, dtype)
    mask = expected.abs().sum(1) != 0
    assert torch.equal(out[mask], expected[mask])
    assert (out[~mask] == 7).all()  # text positions untouched


def test_out_buffer_of_another_dtype_or_strided_is_filled_through_a_copy():
    start, end, width = 3, 17, 16
    full, segments, rows, header = _payload(torch.bfloat16, "main", width, start, end)
    expected = _expected_chunk(full, segments, start, end, width, torch.float32)
    big = torch.zeros(end - start, 2 * width)
    for out in (torch.zeros(end - start, width), big[:, :width]):  # float32 from bf16; non-contiguous
        _, got = wire.decode_http(_http_body(header, rows), out=out, start=start)
        assert torch.equal(got, expected)


def test_grpc_chunks_are_bounded_and_reassemble_in_pieces():
    _, _, rows, header = _payload(torch.float32, "main+deepstack3", 64)
    pieces = list(wire.grpc_data_chunks(rows, max_bytes=1000))
    assert all(len(p) <= 1000 for p in pieces) and sum(map(len, pieces)) == header.payload_bytes
    writer = RowWriter(header)
    for p in pieces:
        writer.write(bytes(p))
    assert torch.equal(writer.finish(), rows)
    assert wire.GRPC_DATA_BYTES < wire.GRPC_MESSAGE_BYTES == 1 << 20


def test_empty_payload():
    header = WireHeader.of([], torch.empty(0, 8), "main")
    got_header, got = wire.decode_http(_http_body(header, torch.empty(0, 8)))
    assert got_header.num_rows == 0 and got.shape == (0, 8)


def test_short_or_corrupt_payloads_raise_clear_errors():
    _, _, rows, header = _payload(torch.float32, "main", 16)
    body = _http_body(header, rows)
    with pytest.raises(WireError, match="shorter than its 4-byte header length"):
        wire.decode_http(body[:3])
    with pytest.raises(WireError, match="exceeds the"):
        wire.decode_http(b"\xff\xff\x00\x00{}")
    with pytest.raises(WireError, match="short: .* of"):
        wire.decode_http(body[:-5])
    with pytest.raises(WireError, match="more than"):
        wire.decode_http(body + b"xx")
    head_len = int.from_bytes(body[:4], "little")
    with pytest.raises(WireError, match="not JSON"):
        wire.decode_http(body[:4] + b"#" * head_len + body[4 + head_len:])
    bad = json.loads(body[4:4 + head_len])
    bad["num_rows"] += 1
    bad_head = json.dumps(bad).encode()
    with pytest.raises(WireError, match="num_rows"):
        wire.decode_http(len(bad_head).to_bytes(4, "little") + bad_head + body[4 + head_len:])
    with pytest.raises(WireError, match="unsupported dtype"):
        WireHeader.from_dict({**bad, "dtype": "int8"})
    with pytest.raises(WireError, match="version"):
        WireHeader.from_dict({**bad, "version": 99})
    with pytest.raises(WireError, match="malformed"):
        WireHeader.from_dict({"version": 1})
    with pytest.raises(WireError, match="not an encoder_service safetensors"):
        wire.decode_safetensors(safetensors.torch.save({"rows": rows}))


def test_out_buffer_mismatch_is_named():
    _, _, rows, header = _payload(torch.float32, "main", 16, 3, 17)
    body = _http_body(header, rows)
    with pytest.raises(WireError, match=r"out must be \[rows, 16\]"):
        wire.decode_http(body, out=torch.zeros(14, 8), start=3)
    with pytest.raises(WireError, match="out has 5 rows"):
        wire.decode_http(body, out=torch.zeros(5, 16), start=3)


def test_header_of_checks_rows_match_segments():
    with pytest.raises(ValueError, match="do not match"):
        WireHeader.of([Segment("a", 0, 0, 3)], torch.zeros(2, 4), "main")


def test_rows_from_bytes():
    rows = torch.randn(5, 6).to(torch.bfloat16)
    assert torch.equal(wire.rows_from_bytes(bytes(wire.row_bytes(rows)), "bfloat16", 6, 5), rows)
    with pytest.raises(WireError, match="short"):
        wire.rows_from_bytes(bytes(wire.row_bytes(rows))[:-2], "bfloat16", 6, 5)
