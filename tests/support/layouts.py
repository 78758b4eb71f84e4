"""Prompts that place images between runs of text, for the fetch tests: chunks that cut an image, hold
several, or none."""
from encoder_service.client import PromptLayout


def prompt_layout(infos, lead: int, gap: int, tail: int) -> PromptLayout:
    """text(lead) img0 text(gap) img1 img2 ... (side by side) text(tail)."""
    items, offset = [], lead
    for k, info in enumerate(infos):
        items.append((info.id, offset, info.num_tokens))
        offset += info.num_tokens + (gap if k == 0 else 0)
    return PromptLayout(items, offset + tail)


def wanted(layout: PromptLayout, start: int, end: int) -> list[tuple[str, int]]:
    """The (id, offset) of each image that overlaps [start, end)."""
    return [(i, o) for i, o, n in layout.items if o < end and start < o + n]
