"""The model directory both sides of the SGLang tier load: our tiny random checkpoint
(encoder_service/testing/tiny.py, built by the main venv, which the encoder serves) plus what SGLang's
language side reads besides the config: a tokenizer. The tiny vocabulary has 256 ids and its vision special
tokens sit at 252..255 (video, vision_start, vision_end, image); this byte-level tokenizer gives ASCII its
own ids below 248 and puts the chat and vision special tokens at the ids the config names."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

SPECIALS = {  # token -> id, as in the tiny config (image_token_id=255, ...)
    "<|endoftext|>": 248, "<|im_start|>": 249, "<|im_end|>": 250, "<|object_ref_start|>": 251,
    "<|video_pad|>": 252, "<|vision_start|>": 253, "<|vision_end|>": 254, "<|image_pad|>": 255,
}
NUM_BYTE_TOKENS = 248


def build(main_python: str, family: str, path: Path) -> Path:
    """Our tiny `family` checkpoint in `path` (built by the main venv's python), with a tokenizer."""
    if not (path / "config.json").exists():
        code = ("import sys; from encoder_service.testing.tiny import build_tiny_checkpoint as build; "
                "build(sys.argv[1], sys.argv[2])")
        subprocess.run([main_python, "-c", code, family, str(path)], check=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[3])
    write_tokenizer(path)
    return path


def write_tokenizer(d: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(NUM_BYTE_TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    for token, i in SPECIALS.items():
        assert tok.token_to_id(token) == i, (token, tok.token_to_id(token), i)
    tok.save(os.path.join(d, "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "model_max_length": 32768, "errors": "replace",
        "add_prefix_space": False, "clean_up_tokenization_spaces": False}))
