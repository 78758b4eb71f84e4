"""Step 3 of the integration: chunked prefill of a transformers Qwen-VL language model with rows
fetched from the encoder service, one chunk at a time.

For a chunk `[start, end)` of the prompt:

  1. ask the service for the rows of the images and video frame groups whose placeholders overlap the
     chunk (`fetch(items, start, end)`); only those rows travel, and the answer says where each run of rows
     lands (`Segment(id, position, row_start, row_end)`; a video's runs are its frame groups, `<id>#<g>`);
  2. embed the chunk's token ids and overwrite the placeholder positions with the rows' main part
     (the `masked_scatter` of transformers, restricted to the chunk);
  3. Qwen3-VL only: the rows also carry deepstack levels `[main | ds_1 | ... | ds_L]`; level k is added
     to the hidden states after decoder layer k-1, at this chunk's visual positions only (transformers
     does it through `visual_pos_masks` / `deepstack_visual_embeds`, which we pass per chunk);
  4. run the language model on the chunk with its slice of the M-RoPE positions and the KV cache of
     the previous chunks (one `DynamicCache`, which each call extends in place; the causal mask is offset
     by the cache length), and project to logits.

Chunks are independent except for the KV cache, so a server can fetch chunk i+1 while chunk i runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from encoder_service.integrations.mrope import mrope_position_ids
from encoder_service.integrations.prompt import VisionPrompt
from encoder_service.ranges import chunks

# fetch(items: list[(id, offset)], start, end) -> an answer with `.segments` (each with `id`,
# `position`, `row_start`, `row_end`, in placeholder order) and `.rows` ([sum of rows, row_width]).
# `EncoderClient.fetch` of encoder_service.client and `EncoderCore.fetch` (awaited) both have it.
FetchFn = Callable[[list[tuple[str, int]], int, int], Any]


@dataclass(frozen=True)
class ChunkReport:
    """What one chunk asked for and what it got (rows counted from the answer, not assumed)."""

    start: int
    end: int
    image_ids: tuple[str, ...]  # images and video frame groups asked for (those overlapping the chunk)
    rows_needed: int  # placeholders inside [start, end)
    rows_received: int  # rows in the fetch answer


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [seq_len, vocab] (or [1, vocab]: the last token only, see `all_logits`)
    past_key_values: Any  # transformers DynamicCache holding the whole prompt
    rope_delta: int  # decode step at cache length n uses M-RoPE position n + rope_delta
    chunks: list[ChunkReport] = field(default_factory=list)


def language_model_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(embed_tokens, decoder stack, lm_head) of a Qwen*VLForConditionalGeneration.

    The decoder stack is `Qwen*VLTextModel`: it takes `inputs_embeds`, 3-axis `position_ids`, the KV cache
    (under `cache_kwarg`'s name) and (Qwen3-VL) `visual_pos_masks` + `deepstack_visual_embeds`.
    """
    text_model = model.model.language_model
    return text_model.get_input_embeddings(), text_model, model.lm_head


def cache_kwarg(text_model: torch.nn.Module) -> str:
    """The name the decoder stack's forward takes the KV cache under: `cache` from transformers 5.24 on (which
    deprecates `past_key_values`, to go in 5.40), `past_key_values` before (5.23, the lowest we support)."""
    return "cache" if "cache" in inspect.signature(text_model.forward).parameters else "past_key_values"


def num_deepstack_levels(config: Any) -> int:
    """Deepstack levels of a checkpoint: len(vision_config.deepstack_visual_indexes) (0 before Qwen3)."""
    return len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])


def _segments_and_rows(answer: Any) -> tuple[list[Any], torch.Tensor]:
    rows = answer.rows
    if not isinstance(rows, torch.Tensor):  # numpy from a client that does not build tensors
        rows = torch.as_tensor(rows)
    return list(answer.segments), rows


@torch.no_grad()
def chunked_prefill(model: torch.nn.Module, prompt: VisionPrompt, fetch: FetchFn, chunk_size: int, *,
                    all_logits: bool = True) -> PrefillResult:
    """Prefill `prompt` through `model` in chunks of `chunk_size` tokens, fetching rows per chunk.

    model: a transformers Qwen2-VL / Qwen2.5-VL / Qwen3-VL `...ForConditionalGeneration` (its vision
      tower is never called). fetch: see `FetchFn`, typically `client.fetch`.
    """
    from transformers import DynamicCache

    config = model.config
    embed_tokens, text_model, lm_head = language_model_parts(model)
    hidden = config.text_config.hidden_size
    levels = num_deepstack_levels(config)  # 0 for Qwen2/2.5-VL, 3 for released Qwen3-VL
    row_width = hidden * (1 + levels)  # a service row: [main | ds_1 | ... | ds_levels], each `hidden`
    device, dtype = embed_tokens.weight.device, embed_tokens.weight.dtype

    # [3, seq_len]: computed once from grid_thw (and a Qwen2.5-VL video's second_per_grid_t); every chunk takes
    # its slice.
    vision = config.vision_config
    position_ids, rope_delta = mrope_position_ids(prompt, vision.spatial_merge_size,
                                                  tokens_per_second=getattr(vision, "tokens_per_second", None))
    cache = DynamicCache(config=config.text_config)  # every chunk's call extends it in place
    cache_name = cache_kwarg(text_model)
    placeholder_ids = torch.tensor([t for t in (prompt.token_ids.image_token_id, prompt.token_ids.video_token_id)
                                    if t is not None], device=device)
    logits_per_chunk: list[torch.Tensor] = []
    reports: list[ChunkReport] = []

    for start, end in chunks(prompt.seq_len, chunk_size):  # [0, c), [c, 2c), ..., remainder
        chunk_len = end - start
        chunk_ids = prompt.input_ids[start:end].to(device)  # [chunk_len]
        inputs_embeds = embed_tokens(chunk_ids)  # [chunk_len, hidden]
        visual_mask = torch.zeros(chunk_len, dtype=torch.bool, device=device)  # placeholders filled
        deepstack = torch.zeros(levels, chunk_len, hidden, dtype=dtype, device=device) if levels else None

        # 1. Fetch only the overlapping images' and frame groups' rows; a text-only chunk makes no request at all.
        wanted = prompt.fetch_items(prompt.slots_overlapping(start, end), start, end)
        rows_received = 0
        if wanted:
            segments, rows = _segments_and_rows(fetch(wanted, start, end))
            if rows.ndim != 2 or rows.shape[1] != row_width:
                raise ValueError(f"rows of shape {tuple(rows.shape)} from the service; this model needs "
                                 f"rows {row_width} wide (hidden {hidden}, {levels} deepstack levels)")
            rows = rows.to(device=device, dtype=dtype)  # [rows_received, row_width]
            rows_received = rows.shape[0]
            # 2./3. Scatter each segment's rows to its prompt positions (relative to the chunk).
            offsets = dict(wanted)
            cursor = 0
            for seg in segments:
                n = seg.row_end - seg.row_start
                at = seg.position - start
                if n <= 0 or at < 0 or at + n > chunk_len or seg.position != offsets.get(seg.id, -1) + seg.row_start:
                    raise ValueError(f"segment {seg} does not fit its image or chunk [{start}, {end})")
                seg_rows = rows[cursor : cursor + n]  # [n, row_width]
                inputs_embeds[at : at + n] = seg_rows[:, :hidden]
                for level in range(levels):
                    deepstack[level, at : at + n] = seg_rows[:, hidden * (level + 1) : hidden * (level + 2)]
                visual_mask[at : at + n] = True
                cursor += n
            if cursor != rows_received:
                raise ValueError(f"segments cover {cursor} rows, the answer carries {rows_received}")
        # Every placeholder of the chunk, and nothing else, must have received a row.
        placeholders = torch.isin(chunk_ids, placeholder_ids)
        if not torch.equal(visual_mask, placeholders):
            raise ValueError(f"chunk [{start}, {end}): rows did not land exactly on the image placeholders")

        # 4. One decoder pass over the chunk; the cache grows by chunk_len.
        kwargs = {}
        if levels and bool(visual_mask.any()):
            kwargs["visual_pos_masks"] = visual_mask[None]  # [1, chunk_len]
            # deepstack_visual_embeds[k]: [visual tokens in chunk, hidden], in position order.
            kwargs["deepstack_visual_embeds"] = [deepstack[level][visual_mask] for level in range(levels)]
        out = text_model(
            inputs_embeds=inputs_embeds[None],  # [1, chunk_len, hidden]
            position_ids=position_ids[:, None, start:end].to(device),  # [3, 1, chunk_len]
            use_cache=True,
            **{cache_name: cache},
            **kwargs,
        )
        last_hidden = out.last_hidden_state[0]  # [chunk_len, hidden]
        if all_logits:
            logits_per_chunk.append(lm_head(last_hidden))
        elif end == prompt.seq_len:
            logits_per_chunk.append(lm_head(last_hidden[-1:]))
        reports.append(ChunkReport(start, end, tuple(item_id for item_id, _ in wanted), int(placeholders.sum()),
                                   rows_received))

    return PrefillResult(torch.cat(logits_per_chunk), cache, rope_delta, reports)


def decode_position_ids(cache_len: int, rope_delta: int, num_tokens: int = 1) -> torch.Tensor:
    """M-RoPE positions [3, 1, num_tokens] for text tokens appended after a prefill (all axes equal)."""
    pos = torch.arange(cache_len, cache_len + num_tokens) + rope_delta
    return pos.view(1, 1, -1).expand(3, 1, -1)


@torch.no_grad()
def decode_step(model: torch.nn.Module, result: PrefillResult, token_ids: torch.Tensor) -> torch.Tensor:
    """Append text tokens `token_ids` [n] to a prefilled sequence (its cache grows by n); logits [n, vocab]."""
    embed_tokens, text_model, lm_head = language_model_parts(model)
    device = embed_tokens.weight.device
    cache_len = result.past_key_values.get_seq_length()
    out = text_model(inputs_embeds=embed_tokens(token_ids.to(device))[None],  # [1, n, hidden]
                     position_ids=decode_position_ids(cache_len, result.rope_delta, len(token_ids)).to(device),
                     use_cache=True, **{cache_kwarg(text_model): result.past_key_values})
    return lm_head(out.last_hidden_state[0])


