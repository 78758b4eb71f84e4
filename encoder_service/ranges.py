"""Range math for chunked prefill: which rows of which images a prompt chunk [start, end) needs.

Pure functions, shared by the core (to answer a fetch) and the client (to fetch only what overlaps).
Positions are prompt positions; an image with `num_tokens` placeholders starting at `offset` covers
positions [offset, offset + num_tokens), and its row r sits at position offset + r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from encoder_service.errors import InvalidInput

PlaceholderItem = tuple[Hashable, int, int]  # (id, offset, num_tokens)
# Prompt positions are int64 on gRPC; HTTP takes the same range, so a position means the same on both.
POSITION_LIMIT = 1 << 63


@dataclass(frozen=True)
class Segment:
    """Rows [row_start, row_end) of image `id` land at prompt positions [position, position + num_rows)."""

    id: Hashable
    position: int
    row_start: int
    row_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class PromptLayout:
    """Where a prompt's images sit: `items` are (id, offset, num_tokens); `prompt_len` counts all tokens."""

    items: tuple[PlaceholderItem, ...]
    prompt_len: int

    def __post_init__(self):
        object.__setattr__(self, "items", tuple((i, int(o), int(n)) for i, o, n in self.items))
        if self.prompt_len < 0:
            raise InvalidInput(f"prompt_len must be >= 0, got {self.prompt_len}")
        for item_id, offset, num_tokens in sorted_items(self.items):
            if offset + num_tokens > self.prompt_len:
                raise InvalidInput(f"image {item_id!r} at offset {offset} with {num_tokens} tokens ends past "
                                   f"the prompt (length {self.prompt_len})")


def sorted_items(items: Iterable[PlaceholderItem]) -> list[PlaceholderItem]:
    """`items` sorted by offset, after checking each range and that no two ranges overlap."""
    ordered = sorted(((i, int(o), int(n)) for i, o, n in items), key=lambda item: item[1])
    prev_end, prev_id = 0, None
    for item_id, offset, num_tokens in ordered:
        check_position(f"image {item_id!r}: offset", offset)
        if num_tokens <= 0:
            raise InvalidInput(f"image {item_id!r}: num_tokens must be > 0, got {num_tokens}")
        if prev_id is not None and offset < prev_end:
            raise InvalidInput(f"placeholder ranges overlap: image {prev_id!r} ends at {prev_end}, "
                               f"image {item_id!r} starts at {offset}")
        prev_end, prev_id = offset + num_tokens, item_id
    return ordered


def check_position(what: str, value: int) -> None:
    """The one bound on prompt positions (offsets, chunk start and end): 0 <= value < 2**63."""
    if value < 0:
        raise InvalidInput(f"{what} must be >= 0, got {value}")
    if value >= POSITION_LIMIT:
        raise InvalidInput(f"{what} must be < 2**63 (prompt positions are int64), got {value}")


def _check_chunk(start: int, end: int) -> None:
    check_position("chunk start", start)
    if end <= start:
        raise InvalidInput(f"chunk end must be > start, got start={start} end={end}")
    check_position("chunk end", end)


def plan_chunk(items: Sequence[PlaceholderItem], start: int, end: int) -> list[Segment]:
    """Segments of the images overlapping [start, end), in placeholder (offset) order.

    Raises InvalidInput for an offset, start or end outside [0, 2**63), a non-positive num_tokens,
    overlapping placeholder ranges, or end <= start.
    """
    _check_chunk(start, end)
    segments = []
    for item_id, offset, num_tokens in sorted_items(items):
        lo, hi = max(start, offset), min(end, offset + num_tokens)
        if lo < hi:
            segments.append(Segment(item_id, lo, lo - offset, hi - offset))
    return segments


def overlapping(items: Sequence[PlaceholderItem], start: int, end: int) -> list[PlaceholderItem]:
    """The items whose placeholder ranges overlap [start, end), in offset order (no validation)."""
    return [item for item in sorted(items, key=lambda item: item[1])
            if item[1] < end and start < item[1] + item[2]]


def chunks(prompt_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) of each chunked-prefill chunk of a prompt: full chunks, then the remainder."""
    if chunk_size <= 0:
        raise InvalidInput(f"chunk_size must be > 0, got {chunk_size}")
    if prompt_len < 0:
        raise InvalidInput(f"prompt_len must be >= 0, got {prompt_len}")
    return [(s, min(s + chunk_size, prompt_len)) for s in range(0, prompt_len, chunk_size)]
