"""Range math: which rows each prompt chunk needs."""

from __future__ import annotations

import itertools

import pytest

from encoder_service.errors import InvalidInput
from encoder_service.ranges import PromptLayout, Segment, chunks, overlapping, plan_chunk


def test_chunk_splits_an_image():
    items = [("a", 2, 10)]
    assert plan_chunk(items, 0, 6) == [Segment("a", 2, 0, 4)]
    assert plan_chunk(items, 6, 12) == [Segment("a", 6, 4, 10)]


def test_several_images_in_one_chunk_in_offset_order():
    items = [("b", 10, 3), ("a", 1, 4), ("c", 14, 2)]  # given out of order
    assert plan_chunk(items, 0, 20) == [Segment("a", 1, 0, 4), Segment("b", 10, 0, 3), Segment("c", 14, 0, 2)]


def test_image_straddling_several_chunks():
    items = [("a", 3, 20)]
    got = [plan_chunk(items, s, e) for s, e in chunks(30, 8)]
    assert got == [[Segment("a", 3, 0, 5)], [Segment("a", 8, 5, 13)], [Segment("a", 16, 13, 20)], []]


def test_text_only_chunk_is_empty():
    items = [("a", 0, 4), ("b", 20, 4)]
    assert plan_chunk(items, 4, 20) == []
    assert plan_chunk([], 0, 5) == []


def test_same_image_twice_in_a_prompt():
    assert plan_chunk([("a", 0, 3), ("a", 5, 3)], 2, 7) == [Segment("a", 2, 2, 3), Segment("a", 5, 0, 2)]


def test_adjacent_images_do_not_overlap():
    assert plan_chunk([("a", 0, 3), ("b", 3, 3)], 2, 4) == [Segment("a", 2, 2, 3), Segment("b", 3, 0, 1)]


@pytest.mark.parametrize("items, start, end, words", [
    ([("a", -1, 3)], 0, 4, "offset must be >= 0"),
    ([("a", 0, 0)], 0, 4, "num_tokens must be > 0"),
    ([("a", 0, 4), ("b", 3, 2)], 0, 8, "overlap"),
    ([("a", 0, 4), ("b", 0, 4)], 0, 8, "overlap"),
    ([("a", 0, 4)], -1, 4, "start must be >= 0"),
    ([("a", 0, 4)], 4, 4, "end must be > start"),
    ([("a", 0, 4)], 5, 2, "end must be > start"),
    ([("a", 2**63, 4)], 0, 4, r"offset must be < 2\*\*63"),  # positions are int64 on gRPC: on HTTP too
    ([("a", 0, 4)], 2**63, 2**63 + 4, r"chunk start must be < 2\*\*63"),
    ([("a", 0, 4)], 0, 2**63, r"chunk end must be < 2\*\*63"),
])
def test_validation(items, start, end, words):
    with pytest.raises(InvalidInput, match=words):
        plan_chunk(items, start, end)


def test_the_largest_int64_position_is_valid():
    last = 2**63 - 1
    assert plan_chunk([("a", last - 4, 4)], last - 2, last) == [Segment("a", last - 2, 2, 4)]


def test_chunks():
    assert chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunks(8, 4) == [(0, 4), (4, 8)]
    assert chunks(0, 4) == []
    with pytest.raises(InvalidInput, match="chunk_size"):
        chunks(10, 0)


def test_overlapping():
    items = [("b", 10, 3), ("a", 1, 4)]
    assert overlapping(items, 0, 1) == []
    assert overlapping(items, 4, 11) == [("a", 1, 4), ("b", 10, 3)]
    assert overlapping(items, 5, 10) == []


def test_prompt_layout_validates():
    assert PromptLayout([("a", 2, 3)], 5).items == (("a", 2, 3),)
    with pytest.raises(InvalidInput, match="ends past the prompt"):
        PromptLayout([("a", 2, 3)], 4)
    with pytest.raises(InvalidInput, match="overlap"):
        PromptLayout([("a", 0, 3), ("b", 2, 3)], 10)


def _layouts(prompt_len: int):
    """Every way to place up to 2 images (sizes 1..3) without overlap in a prompt of `prompt_len`."""
    yield []
    for n1 in range(1, 4):
        for o1 in range(prompt_len - n1 + 1):
            yield [("x", o1, n1)]
            for n2 in range(1, 4):
                for o2 in range(o1 + n1, prompt_len - n2 + 1):
                    yield [("x", o1, n1), ("y", o2, n2)]


def test_exhaustive_every_row_exactly_once():
    """Over all chunkings of small prompts, the segments cover every image row once, at its own position."""
    cases = 0
    for prompt_len, chunk_size in itertools.product(range(1, 9), range(1, 10)):
        for items in _layouts(prompt_len):
            seen = []
            for start, end in chunks(prompt_len, chunk_size):
                for seg in plan_chunk(items, start, end):
                    assert start <= seg.position and seg.position + seg.num_rows <= end
                    assert seg.num_rows > 0
                    offset = next(o for i, o, _ in items if i == seg.id)
                    assert seg.position == offset + seg.row_start
                    seen += [(seg.id, r) for r in range(seg.row_start, seg.row_end)]
            assert sorted(seen) == sorted((i, r) for i, _, n in items for r in range(n))
            cases += 1
    assert cases > 1000
