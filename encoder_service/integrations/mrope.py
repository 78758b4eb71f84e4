"""Step 2 of the integration: M-RoPE position ids from `grid_thw` (no pixels, no vision tower).

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate queries and keys by three position ids per token
(temporal, height, width). Text tokens carry the same id on all three axes and count up by one. An image
of merged grid `(t, h/merge, w/merge)` whose first placeholder comes when the running position is `p`
gets, for its token at `(ti, hi, wi)` (row-major, the placeholder order), the ids
`(p + ti, p + hi, p + wi)`, and the running position then advances by `max(h, w) / merge` (not by the
number of tokens). So positions fall behind token indices; `rope_delta = max position + 1 - seq_len`
is what decoding adds to the cache length to continue the sequence.

This equals transformers' `Qwen*VLModel.get_rope_index` for still images (t = 1, time interval 1;
tested against it in tests/service/test_integration_prefill.py).
"""

from __future__ import annotations

import torch

from encoder_service.integrations.prompt import VisionPrompt


def mrope_position_ids(prompt: VisionPrompt, spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Returns (position_ids [3, seq_len] int64, rope_delta int) for the whole prompt.

    A chunk `[start, end)` uses `position_ids[:, start:end]`; a decode step at cache length `n` uses
    position `n + rope_delta` on all three axes.
    """
    seq_len = prompt.seq_len
    position_ids = torch.empty(3, seq_len, dtype=torch.long)
    next_pos = 0  # the running position: the id the next text token gets
    cursor = 0  # the next prompt index to fill
    for img in prompt.images:  # placeholder order, non-overlapping (checked by VisionPrompt)
        text_len = img.offset - cursor
        position_ids[:, cursor : img.offset] = torch.arange(next_pos, next_pos + text_len)
        next_pos += text_len

        t, h, w = img.grid_thw
        llm_t, llm_h, llm_w = t, h // spatial_merge_size, w // spatial_merge_size
        if llm_t * llm_h * llm_w != img.num_tokens:
            raise ValueError(f"image {img.id}: grid_thw {img.grid_thw} gives {llm_t * llm_h * llm_w} "
                             f"tokens with merge {spatial_merge_size}, num_tokens is {img.num_tokens}")
        # [3, llm_t, llm_h, llm_w] -> [3, num_tokens] in row-major (t, h, w) order = placeholder order.
        grid = torch.stack(torch.meshgrid(torch.arange(llm_t), torch.arange(llm_h), torch.arange(llm_w),
                                          indexing="ij"))
        position_ids[:, img.offset : img.end] = grid.reshape(3, -1) + next_pos
        next_pos += max(llm_h, llm_w)
        cursor = img.end
    position_ids[:, cursor:] = torch.arange(next_pos, next_pos + seq_len - cursor)
    rope_delta = int(position_ids.max()) + 1 - seq_len if seq_len else 0
    return position_ids, rope_delta
