"""Tiny random-weight Qwen-VL checkpoints that keep the real structure, for tests and the offline demo.

`build_tiny_checkpoint(family, path, seed=0)` saves a full VL model (transformers' own class, tiny 4-layer language
model, special token ids inside its vocabulary) with save_pretrained as several safetensors shards, plus a
preprocessor_config.json written by transformers' own image processor with small min/max pixels (a 64x64 image is 4
tokens) and, for Qwen3-VL, a video_preprocessor_config.json as the published checkpoints have.

`text_head_dim` (24) sets the language model's head size (2 heads: its width, and so the merger's output, is
twice that): vLLM's CPU attention takes 32, 64, 80, 96, ... only, so the vllm-e2e tier builds 32. `text_std`
(0.2, as the vision tower) is the language model's weight scale: at 0.6 its greedy answer follows the image
(at 0.2 most images get the same token every step, so equal answers would prove little).

`add_tiny_tokenizer(path)` adds what an LLM server's front end needs on top (vLLM's renderer and processor, SGLang's
Qwen-VL processor: the engine tiers): a character-level tokenizer whose special ids match the checkpoint's, and a
chat template that renders each image part as `<|vision_start|><|image_pad|><|vision_end|>`.

Structure kept per family:
  - qwen2_vl: quick_gelu MLP (mlp_ratio 2), LayerNorm merger.
  - qwen2_5_vl: window_size 56 px = 2x2 merged tokens per window, so a 112x112 image already has 4 windows;
    blocks 1 and 3 of 4 use full attention, 0 and 2 windows.
  - qwen3_vl / qwen3_vl_moe: 3 deepstack levels (blocks 1, 2, 3 of 5), a 4x4 learned position table
    (interpolated for every other grid), patch 16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Vision towers: width 32, 2 heads (head_dim 16), merger output 48 = the tiny LLM's hidden size.
_WIDTH, _HEADS, _OUT = 32, 2, 48
_MIN_PIXELS_TOKENS, _MAX_PIXELS_TOKENS = 4, 64  # min/max merged tokens per image

_TEXT = dict(
    vocab_size=256,
    intermediate_size=64,
    num_hidden_layers=4,  # >= 4 so each of Qwen3's 3 deepstack levels is added at its own layer
    num_attention_heads=2,
    num_key_value_heads=1,
    bos_token_id=None,
    eos_token_id=None,
)

_VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=_WIDTH, hidden_size=_OUT, mlp_ratio=2, num_heads=_HEADS, patch_size=14),
    "qwen2_5_vl": dict(
        depth=4,
        hidden_size=_WIDTH,
        intermediate_size=40,
        num_heads=_HEADS,
        out_hidden_size=_OUT,
        patch_size=14,
        window_size=56,
        fullatt_block_indexes=[1, 3],
    ),
    "qwen3_vl": dict(
        depth=5,
        hidden_size=_WIDTH,
        intermediate_size=48,
        num_heads=_HEADS,
        out_hidden_size=_OUT,
        patch_size=16,
        num_position_embeddings=16,
        deepstack_visual_indexes=[1, 2, 3],
    ),
}
_VISION["qwen3_vl_moe"] = _VISION["qwen3_vl"]

# Image normalisation of the real checkpoints: CLIP's for Qwen2/2.5, 0.5 / 0.5 for Qwen3.
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
_HALF = [0.5, 0.5, 0.5]

# The released special ids (151655, ...) lie outside the tiny vocabulary; use its last four ids instead so
# transformers' own full-model forward can embed a prompt (tests compare LLM logits end to end).
_SPECIAL_IDS = dict(video_token_id=252, vision_start_token_id=253, vision_end_token_id=254, image_token_id=255)

TINY_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def _text_config(family: str, head_dim: int) -> dict:
    # 2 heads of head_dim: the width is 2 * head_dim. M-RoPE sections sum to head_dim / 2, split as the
    # released checkpoints' (128: 16, 24, 24): 24 -> 4, 4, 4; 32 -> 4, 6, 6.
    side = 3 * head_dim // 16
    mrope = [head_dim // 2 - 2 * side, side, side]
    text = _TEXT | {"hidden_size": 2 * head_dim, "num_attention_heads": 2}
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return text | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope}}
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": mrope, "mrope_interleaved": True}
    text = text | {"head_dim": head_dim, "rope_parameters": rope}
    if family == "qwen3_vl_moe":
        text |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
    return text


def _model_class_and_config(family: str, text_head_dim: int = 24):
    import transformers as tf

    classes = {
        "qwen2_vl": (tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLConfig),
        "qwen2_5_vl": (tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLConfig),
        "qwen3_vl": (tf.Qwen3VLForConditionalGeneration, tf.Qwen3VLConfig),
        "qwen3_vl_moe": (tf.Qwen3VLMoeForConditionalGeneration, tf.Qwen3VLMoeConfig),
    }
    if family not in classes:
        raise ValueError(f"unknown tiny family {family!r}; choose from {TINY_FAMILIES}")
    model_cls, config_cls = classes[family]
    width = 2 * text_head_dim  # the language model's, which the merger emits
    vision = _VISION[family] | ({"hidden_size": width} if family == "qwen2_vl" else {"out_hidden_size": width})
    config = config_cls(vision_config=vision, text_config=_text_config(family, text_head_dim), **_SPECIAL_IDS)
    return model_cls, config


def build_tiny_checkpoint(family: str, path: str | Path, seed: int = 0, *, text_head_dim: int = 24,
                          text_std: float = 0.2) -> Path:
    """Write a tiny `family` checkpoint into `path` (created) and return it."""
    from transformers import Qwen2VLImageProcessorPil

    model_cls, config = _model_class_and_config(family, text_head_dim)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # Random weights with a fixed seed; std 0.2 rather than the 0.02 init so attention is far from uniform.
    generator = torch.Generator().manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.2 if "visual" in name else text_std))
    model.save_pretrained(path, max_shard_size="64KB", safe_serialization=True)

    vision = _VISION[family]
    factor = vision["patch_size"] * 2
    mean, std = (_HALF, _HALF) if family.startswith("qwen3") else (_CLIP_MEAN, _CLIP_STD)
    processor = Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"],
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=_MIN_PIXELS_TOKENS * factor**2,
        max_pixels=_MAX_PIXELS_TOKENS * factor**2,
        image_mean=mean,
        image_std=std,
    )
    processor.save_pretrained(path)
    if family.startswith("qwen3"):
        _write_qwen3_video_config(path, factor)
    _check_shards(path)
    return path


def _write_qwen3_video_config(path: Path, factor: int) -> None:
    """What the published Qwen3-VL checkpoints have beside the image file (Qwen2/2.5-VL have none: their videos
    use the image file): Qwen3VLVideoProcessor's settings, with a small pixel budget over all frames (24 frames
    of 4 tokens). Written as JSON: saving transformers' video processor would need torchvision."""
    settings = {
        "video_processor_type": "Qwen3VLVideoProcessor", "patch_size": factor // 2, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": _HALF, "image_std": _HALF,
        "size": {"shortest_edge": _MIN_PIXELS_TOKENS * factor**2, "longest_edge": 24 * 4 * factor**2},
        "do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 768,
    }
    (path / "video_preprocessor_config.json").write_text(json.dumps(settings, indent=1))


def _check_shards(path: Path) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    if len(set(index["weight_map"].values())) < 2:
        raise RuntimeError(f"tiny checkpoint in {path} has a single shard; tests need several")


# Special tokens of the tiny tokenizer: the checkpoint's image / video / vision ids (_SPECIAL_IDS) and chat markers.
_TOKENIZER_SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2,
                       "<|video_pad|>": _SPECIAL_IDS["video_token_id"],
                       "<|vision_start|>": _SPECIAL_IDS["vision_start_token_id"],
                       "<|vision_end|>": _SPECIAL_IDS["vision_end_token_id"],
                       "<|image_pad|>": _SPECIAL_IDS["image_token_id"]}
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' or 'video' in c or 'video_url' in c %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_tiny_tokenizer(path: str | Path) -> Path:
    """Write a character-level WordLevel tokenizer (a-z, 0-9, newline, a few words; one token per character)
    and a chat template into the tiny checkpoint at `path`; returns `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    vocab = dict(_TOKENIZER_SPECIALS)
    words = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)] + \
        ["\n", " ", "user", "assistant", "system"]
    free = (i for i in range(3, 252) if i not in vocab.values())
    for word in words:
        vocab[word] = next(free)
    vocab["<unk>"] = next(free)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.add_special_tokens(list(_TOKENIZER_SPECIALS))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "<unk>", "model_max_length": 4096, "chat_template": _CHAT_TEMPLATE}, indent=1))
    (path / "chat_template.jinja").write_text(_CHAT_TEMPLATE)
    return path
