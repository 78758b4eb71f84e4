"""Step 1 of the integration: lay out the prompt from what `encode` answered.

The chat template of every Qwen-VL model writes one image as

    <|vision_start|> <|image_pad|> <|vision_end|>

and the model's processor then repeats `<|image_pad|>` until the image has one placeholder per merged
token. With the encoder service the LLM server never sees pixels: `encode` answers each image's
`num_tokens` (and `grid_thw`) as soon as the header is read, and that is all the prompt layout needs.

`build_prompt` writes such a prompt from text token ids and encoded images; `expand_image_pads` does the
processor's job on a prompt that was already tokenized with one `<|image_pad|>` per image (what a
server that runs the chat template has in hand). Both return a `VisionPrompt`: the token ids plus, per
image, the position of its first placeholder (`offset`), which is what `fetch` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from encoder_service.errors import InvalidInput


@dataclass(frozen=True)
class VisionTokenIds:
    """The special token ids of one checkpoint (read from its config, never hard-coded)."""

    image_token_id: int  # <|image_pad|>, 151655 in every released Qwen-VL checkpoint
    vision_start_token_id: int  # <|vision_start|>
    vision_end_token_id: int  # <|vision_end|>

    @classmethod
    def from_config(cls, config: Any) -> VisionTokenIds:
        """`config`: a transformers Qwen*VLConfig, or the dict of its config.json."""
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
        ids = {k: get(k) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
        missing = [k for k, v in ids.items() if v is None]
        if missing:
            raise InvalidInput(f"config has no {', '.join(missing)}: not a Qwen-VL checkpoint config")
        return cls(**{k: int(v) for k, v in ids.items()})


@dataclass(frozen=True)
class ImageSlot:
    """One image's place in the prompt: placeholders `[offset, offset + num_tokens)`."""

    id: str  # the service's id for the image (from `encode`)
    offset: int  # prompt position of the image's first placeholder
    num_tokens: int  # t*h*w / merge^2, as answered by `encode`
    grid_thw: tuple[int, int, int]  # patch grid, as answered by `encode`; M-RoPE needs it

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(frozen=True)
class VisionPrompt:
    input_ids: torch.Tensor  # [seq_len] int64, placeholders included
    images: tuple[ImageSlot, ...]  # in placeholder order (= the order of the service's rows)
    token_ids: VisionTokenIds

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[0])

    def images_overlapping(self, start: int, end: int) -> list[ImageSlot]:
        """The images with at least one placeholder in the chunk `[start, end)`, in placeholder order."""
        return [img for img in self.images if img.offset < end and img.end > start]

    @property
    def placeholder_items(self) -> list[tuple[str, int, int]]:
        """`(id, offset, num_tokens)` per image: the items of `encoder_service.ranges`."""
        return [(img.id, img.offset, img.num_tokens) for img in self.images]

    def fetch_items(self, images: Sequence[ImageSlot] | None = None) -> list[tuple[str, int]]:
        """`(id, offset)` pairs, the `items` argument of the service's `fetch`."""
        return [(img.id, img.offset) for img in (self.images if images is None else images)]

    @property
    def grid_thw(self) -> list[tuple[int, int, int]]:
        return [img.grid_thw for img in self.images]

    @property
    def mm_token_type_ids(self) -> torch.Tensor:
        """[seq_len] int32: 1 at image placeholders, 0 elsewhere (what transformers' processor returns)."""
        return (self.input_ids == self.token_ids.image_token_id).to(torch.int32)


def _image_fields(image: Any) -> tuple[str, int, tuple[int, int, int]]:
    """(id, num_tokens, grid_thw) of an `encode` answer: an ImageInfo-like object or a JSON dict."""
    if isinstance(image, dict):
        return str(image["id"]), int(image["num_tokens"]), tuple(int(x) for x in image["grid_thw"])
    return str(image.id), int(image.num_tokens), tuple(int(x) for x in image.grid_thw)


def build_prompt(parts: Sequence[Sequence[int] | Any], token_ids: VisionTokenIds) -> VisionPrompt:
    """Concatenate text and images in order.

    parts: each either a sequence of text token ids, or one image as answered by `encode` (an object or
    dict with `id`, `num_tokens`, `grid_thw`). Every image becomes
    `vision_start, image_token x num_tokens, vision_end`, as the chat template plus processor write it.
    """
    ids: list[int] = []
    images: list[ImageSlot] = []
    for part in parts:
        if isinstance(part, (list, tuple, torch.Tensor)):
            ids.extend(int(t) for t in part)
            continue
        image_id, n, grid_thw = _image_fields(part)
        ids.append(token_ids.vision_start_token_id)
        images.append(ImageSlot(image_id, len(ids), n, grid_thw))
        ids.extend([token_ids.image_token_id] * n)
        ids.append(token_ids.vision_end_token_id)
    prompt = VisionPrompt(torch.tensor(ids, dtype=torch.long), tuple(images), token_ids)
    _check_prompt(prompt)
    return prompt


def expand_image_pads(input_ids: Sequence[int] | torch.Tensor, images: Sequence[Any],
                      token_ids: VisionTokenIds) -> VisionPrompt:
    """Expand a tokenized chat prompt that holds one `<|image_pad|>` per image to `num_tokens` each."""
    flat = [int(t) for t in (input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids)]
    pad = token_ids.image_token_id
    if flat.count(pad) != len(images):
        raise InvalidInput(f"prompt has {flat.count(pad)} image pads but {len(images)} images were given")
    ids: list[int] = []
    slots: list[ImageSlot] = []
    pending = iter(images)
    for tok in flat:
        if tok != pad:
            ids.append(tok)
            continue
        image_id, n, grid_thw = _image_fields(next(pending))
        slots.append(ImageSlot(image_id, len(ids), n, grid_thw))
        ids.extend([pad] * n)
    prompt = VisionPrompt(torch.tensor(ids, dtype=torch.long), tuple(slots), token_ids)
    _check_prompt(prompt)
    return prompt


def _check_prompt(prompt: VisionPrompt) -> None:
    # transformers' rope index groups consecutive image tokens into one run, so two images must never
    # touch; the vision_start / vision_end wrapping guarantees that. Check it instead of assuming it.
    ids = prompt.input_ids
    for img in prompt.images:
        if img.num_tokens <= 0:
            raise InvalidInput(f"image {img.id} has num_tokens {img.num_tokens}")
        if img.offset == 0 or ids[img.offset - 1] == prompt.token_ids.image_token_id or (
            img.end < len(ids) and ids[img.end] == prompt.token_ids.image_token_id
        ):
            raise InvalidInput(f"image {img.id} at {img.offset} is not wrapped in vision_start/vision_end")
    expected = sum(img.num_tokens for img in prompt.images)
    found = int((ids == prompt.token_ids.image_token_id).sum())
    if found != expected:
        raise InvalidInput(f"prompt holds {found} image tokens, the images need {expected}")
