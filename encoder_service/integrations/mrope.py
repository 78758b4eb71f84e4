"""Step 2 of the integration: M-RoPE position ids from `grid_thw` (no pixels, no vision tower).

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate queries and keys by three position ids per token
(temporal, height, width). Text tokens carry the same id on all three axes and count up by one. An image
of merged grid `(t, h/merge, w/merge)` whose first placeholder comes when the running position is `p`
gets, for its token at `(ti, hi, wi)` (row-major, the placeholder order), the ids
`(p + ti, p + hi, p + wi)`, and the running position then advances by `max(h, w) / merge` (not by the
number of tokens). So positions fall behind token indices; `rope_delta = max position + 1 - seq_len`
is what decoding adds to the cache length to continue the sequence.

Videos (prompt.py's VideoSlot): a Qwen2/2.5-VL video is one run of grid (t, h, w) whose temporal ids are
`p + int(ti * interval)`, the interval `tokens_per_second * second_per_grid_t` for Qwen2.5-VL (in float32,
as transformers computes it from its processor's tensor) and 1 for Qwen2-VL (`tokens_per_second=None`);
a Qwen3-VL frame group is positioned like an image of grid (1, h, w). After every slot the running position
is its largest id + 1: for an image (and a Qwen3-VL group) that is `p + max(h, w) / merge`, as above.

This equals transformers' `Qwen*VLModel.get_rope_index` (tested against it in
tests/service/test_integration_prefill.py and test_integration_prefill_video.py) except in one case:
after a Qwen2/2.5-VL video whose temporal ids pass its spatial ones, transformers 5.x (5.23, 5.24) continues
at `p + max(h, w) / merge`, inside the video's time range; Qwen's own implementation (transformers 4.x, the
one the models were trained with), vLLM and SGLang continue after the largest id, as here (SGLang's own
positions are checked against these in tests/engines/sglang/).
"""

from __future__ import annotations

import torch

from encoder_service.integrations.prompt import VideoSlot, VisionPrompt


def mrope_position_ids(prompt: VisionPrompt, spatial_merge_size: int, *,
                       tokens_per_second: float | None = None) -> tuple[torch.Tensor, int]:
    """Returns (position_ids [3, seq_len] int64, rope_delta int) for the whole prompt. `tokens_per_second`:
    Qwen2.5-VL's `vision_config.tokens_per_second` (None for Qwen2-VL and Qwen3-VL).

    A chunk `[start, end)` uses `position_ids[:, start:end]`; a decode step at cache length `n` uses
    position `n + rope_delta` on all three axes.
    """
    seq_len = prompt.seq_len
    position_ids = torch.empty(3, seq_len, dtype=torch.long)
    next_pos = 0  # the running position: the id the next text token gets
    cursor = 0  # the next prompt index to fill
    for slot in prompt.slots:  # prompt order, non-overlapping (checked by VisionPrompt)
        text_len = slot.offset - cursor
        position_ids[:, cursor : slot.offset] = torch.arange(next_pos, next_pos + text_len)
        next_pos += text_len

        t, h, w = slot.grid_thw
        llm_t, llm_h, llm_w = t, h // spatial_merge_size, w // spatial_merge_size
        if llm_t * llm_h * llm_w != slot.num_tokens:
            raise ValueError(f"{slot.id}: grid_thw {slot.grid_thw} gives {llm_t * llm_h * llm_w} "
                             f"tokens with merge {spatial_merge_size}, num_tokens is {slot.num_tokens}")
        temporal = torch.arange(llm_t)
        if isinstance(slot, VideoSlot) and tokens_per_second is not None:
            if slot.second_per_grid_t is None:
                raise ValueError(f"video {slot.id}: Qwen2.5-VL's M-RoPE needs its second_per_grid_t")
            interval = tokens_per_second * torch.tensor(slot.second_per_grid_t, dtype=torch.float32)
            temporal = (temporal * interval).long()
        # [3, llm_t, llm_h, llm_w] -> [3, num_tokens] in row-major (t, h, w) order = placeholder order.
        grid = torch.stack(torch.meshgrid(temporal, torch.arange(llm_h), torch.arange(llm_w), indexing="ij"))
        position_ids[:, slot.offset : slot.end] = grid.reshape(3, -1) + next_pos
        next_pos = int(position_ids[:, slot.offset : slot.end].max()) + 1
        cursor = slot.end
    position_ids[:, cursor:] = torch.arange(next_pos, next_pos + seq_len - cursor)
    rope_delta = int(position_ids.max()) + 1 - seq_len if seq_len else 0
    return position_ids, rope_delta
