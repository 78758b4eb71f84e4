"""Reference integration: a Qwen-VL language model prefilled with rows from the encoder service.
(vLLM's own integration, an EC connector and a chat proxy, is the subpackage `vllm`: docs/vllm.md.)

This package is what an LLM-server author reads to wire the service in. It drives a transformers
Qwen2-VL / Qwen2.5-VL / Qwen3-VL model; an engine with its own kernels does the same five steps.

1. Encode. `client.encode(images)` answers per image, before the ViT has run: `id`, `grid_thw`
   (t, h, w in patches) and `num_tokens` (= t*h*w / merge^2). `client.encode_videos(videos)` answers per
   video `video_grid_thw`, `tokens_per_group` and the metadata of its family (`second_per_grid_t`,
   `group_timestamps`).

2. Lay out the prompt (`prompt.py`). Each image becomes
   `<|vision_start|> <|image_pad|> x num_tokens <|vision_end|>` with the token ids read from the
   checkpoint's config (`VisionTokenIds.from_config`); each video as its family's processor writes it
   (Qwen3-VL: a `<t seconds>` text and vision start / end around each frame group). The result, a
   `VisionPrompt`, holds the token ids and its slots: per image, `offset` = the position of its first
   placeholder, and per video the offsets of its frame groups. `(id, offset)` is a fetch item (a video's:
   `(<id>#<g>, offset of group g)`, `prompt.fetch_items`).

3. M-RoPE positions (`mrope.py`). `mrope_position_ids(prompt, merge, tokens_per_second=...)` ->
   `[3, seq_len]` and `rope_delta`, from the grids alone (and Qwen2.5-VL's second_per_grid_t); equal to
   transformers' `get_rope_index`. Decoding continues at `cache_len + rope_delta`.

4. Chunked prefill (`prefill.py`). For each chunk `[start, end)`: fetch only the rows of the images and
   frame groups that overlap it (`client.fetch(items, start, end)`; a chunk without any fetches nothing), write
   the main part of each row into the chunk's input embeddings at its placeholder position, and run
   the decoder on the chunk with the chunk's slice of the positions and the KV cache of the previous
   chunks. Qwen3-VL rows are `[main | ds_1 | ds_2 | ds_3]`: level k is added to the hidden states
   after decoder layer k-1, at the chunk's visual positions.

5. Decode as usual from the cache, at positions `cache_len + rope_delta` (`decode_step`).

`chunked_prefill` returns the logits (equal to transformers' forward with pixel_values on the same
prompt; tests/service/test_integration_prefill.py) and, per chunk, the rows it needed and received.

Example (the client answers ImageInfo-like objects and FetchResult-like answers, see docs/interfaces.md):

    infos = client.encode([png_a, png_b])
    prompt = build_prompt([system_ids, infos[0], infos[1], question_ids],
                          VisionTokenIds.from_config(model.config))
    result = chunked_prefill(model, prompt, client.fetch, chunk_size=2048)
    next_token = result.logits[-1].argmax()
"""

from encoder_service.integrations.mrope import mrope_position_ids
from encoder_service.integrations.prefill import (
    ChunkReport,
    PrefillResult,
    chunked_prefill,
    decode_position_ids,
    decode_step,
    language_model_parts,
    num_deepstack_levels,
)
from encoder_service.integrations.prompt import (
    ImageSlot,
    VideoSlot,
    VisionPrompt,
    VisionTokenIds,
    build_prompt,
    expand_image_pads,
)

__all__ = [
    "ChunkReport",
    "ImageSlot",
    "PrefillResult",
    "VideoSlot",
    "VisionPrompt",
    "VisionTokenIds",
    "build_prompt",
    "chunked_prefill",
    "decode_position_ids",
    "decode_step",
    "expand_image_pads",
    "language_model_parts",
    "mrope_position_ids",
    "num_deepstack_levels",
]
