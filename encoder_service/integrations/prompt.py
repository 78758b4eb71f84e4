"""Step 1 of the integration: lay out the prompt from what `encode` answered.

The chat template of every Qwen-VL model writes one image as

    <|vision_start|> <|image_pad|> <|vision_end|>

and the model's processor then repeats `<|image_pad|>` until the image has one placeholder per merged
token. With the encoder service the LLM server never sees pixels: `encode` answers each image's
`num_tokens` (and `grid_thw`) as soon as the header is read, and that is all the prompt layout needs.

A video is written `<|vision_start|> <|video_pad|> <|vision_end|>` by the template, and its processor
expands it by family (transformers' Qwen2_5_VLProcessor / Qwen3VLProcessor):

    Qwen2-VL, Qwen2.5-VL  <|vision_start|> <|video_pad|> x num_tokens <|vision_end|>
    Qwen3-VL              <|vision_start|>  then per frame group g:  <{t_g:.1f} seconds> (text)
                          <|vision_start|> <|video_pad|> x tokens_per_group <|vision_end|>  then <|vision_end|>

`encode` answered the video's `video_grid_thw`, `tokens_per_group` and the metadata of its family
(`second_per_grid_t`, or `group_timestamps`): all the layout needs, with the tokenizer for the timestamps.

`build_prompt` writes such a prompt from text token ids and encoded images and videos; `expand_image_pads`
does the processor's job on a prompt that was already tokenized with one pad per image or video (what a
server that runs the chat template has in hand). Both return a `VisionPrompt`: the token ids plus its slots
in prompt order: per image (`ImageSlot`) the position of its first placeholder (`offset`), which is what
`fetch` takes with its id; per video (`VideoSlot`) one slot for a Qwen2/2.5-VL video, one per frame group
for Qwen3-VL, each fetched by its frame groups' ids (`fetch_items`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from encoder_service.errors import InvalidInput
from encoder_service.protocol.video_info import GROUP_SEP

Tokenize = Callable[[str], Sequence[int]]  # text -> token ids, no special tokens (the timestamps' text)


@dataclass(frozen=True)
class VisionTokenIds:
    """The special token ids of one checkpoint (read from its config, never hard-coded)."""

    image_token_id: int  # <|image_pad|>, 151655 in every released Qwen-VL checkpoint
    vision_start_token_id: int  # <|vision_start|>
    vision_end_token_id: int  # <|vision_end|>
    video_token_id: int | None = None  # <|video_pad|>, 151656; None: the config has none (no videos)

    @classmethod
    def from_config(cls, config: Any) -> VisionTokenIds:
        """`config`: a transformers Qwen*VLConfig, or the dict of its config.json."""
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
        ids = {k: get(k) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
        missing = [k for k, v in ids.items() if v is None]
        if missing:
            raise InvalidInput(f"config has no {', '.join(missing)}: not a Qwen-VL checkpoint config")
        video = get("video_token_id")
        return cls(**{k: int(v) for k, v in ids.items()}, video_token_id=None if video is None else int(video))


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

    def fetch_items(self) -> list[tuple[str, int, int]]:
        return [(self.id, self.offset, self.num_tokens)]


@dataclass(frozen=True)
class VideoSlot:
    """A run of a video's placeholders `[offset, offset + num_tokens)`: its frame groups `first_group`,
    `first_group + 1`, ..., `tokens_per_group` rows each. Qwen2/2.5-VL: the whole video, grid (t, h, w);
    Qwen3-VL: one frame group, grid (1, h, w), positioned like an image."""

    id: str  # the video's id (from `encode`); its groups are <id>#<g>
    offset: int
    num_tokens: int
    grid_thw: tuple[int, int, int]
    tokens_per_group: int
    first_group: int = 0
    second_per_grid_t: float | None = None  # Qwen2/2.5-VL: M-RoPE's time step per frame group

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def fetch_items(self) -> list[tuple[str, int, int]]:
        """(group id, offset, rows) of each frame group in the slot."""
        n = self.num_tokens // self.tokens_per_group
        return [(f"{self.id}{GROUP_SEP}{self.first_group + k}", self.offset + k * self.tokens_per_group,
                 self.tokens_per_group) for k in range(n)]


Slot = ImageSlot | VideoSlot


@dataclass(frozen=True)
class VisionPrompt:
    input_ids: torch.Tensor  # [seq_len] int64, placeholders included
    slots: tuple[Slot, ...]  # in prompt order (= the order of the service's rows)
    token_ids: VisionTokenIds

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def images(self) -> tuple[ImageSlot, ...]:
        return tuple(s for s in self.slots if isinstance(s, ImageSlot))

    def slots_overlapping(self, start: int, end: int) -> list[Slot]:
        """The slots with at least one placeholder in the chunk `[start, end)`, in prompt order."""
        return [s for s in self.slots if s.offset < end and s.end > start]

    def fetch_items(self, slots: Sequence[Slot] | None = None, start: int = 0,
                    end: int | None = None) -> list[tuple[str, int]]:
        """`(id, offset)` pairs, the `items` argument of the service's `fetch`: the images' and the frame
        groups' of `slots` (default: all) that overlap `[start, end)`."""
        end = self.seq_len if end is None else end
        return [(i, at) for s in (self.slots if slots is None else slots) for i, at, n in s.fetch_items()
                if at < end and at + n > start]

    @property
    def grid_thw(self) -> list[tuple[int, int, int]]:
        """The images' grids (transformers' image_grid_thw)."""
        return [img.grid_thw for img in self.images]

    @property
    def mm_token_type_ids(self) -> torch.Tensor:
        """[seq_len] int32: 1 at image placeholders, 2 at video placeholders, 0 elsewhere (what transformers'
        processor returns)."""
        types = (self.input_ids == self.token_ids.image_token_id).to(torch.int32)
        if self.token_ids.video_token_id is not None:
            types[self.input_ids == self.token_ids.video_token_id] = 2
        return types


def _image_fields(image: Any) -> tuple[str, int, tuple[int, int, int]]:
    """(id, num_tokens, grid_thw) of an `encode` answer: an ImageInfo-like object or a JSON dict."""
    if isinstance(image, dict):
        return str(image["id"]), int(image["num_tokens"]), tuple(int(x) for x in image["grid_thw"])
    return str(image.id), int(image.num_tokens), tuple(int(x) for x in image.grid_thw)


def _is_video(part: Any) -> bool:
    return ("video_grid_thw" in part) if isinstance(part, dict) else hasattr(part, "video_grid_thw")


def _video_layout(video: Any, token_ids: VisionTokenIds, at: int,
                  timestamp_tokens: Tokenize | None) -> tuple[list[int], list[VideoSlot]]:
    """The token ids that replace a video's one `<|video_pad|>` (inside the template's vision start and end),
    and its slots, the first token at prompt position `at`. `video`: a VideoInfo-like object or JSON dict."""
    get = video.get if isinstance(video, dict) else lambda k: getattr(video, k)
    if token_ids.video_token_id is None:
        raise InvalidInput("this checkpoint's config has no video_token_id: it takes no videos")
    vid, per = str(get("id")), int(get("tokens_per_group"))
    t, h, w = (int(x) for x in get("video_grid_thw"))
    pad = token_ids.video_token_id
    timestamps = get("group_timestamps")
    if timestamps is None:  # Qwen2/2.5-VL: one run
        second = get("second_per_grid_t")
        return [pad] * (t * per), [VideoSlot(vid, at, t * per, (t, h, w), per, 0,
                                             None if second is None else float(second))]
    if timestamp_tokens is None:
        raise InvalidInput(f"video {vid}: Qwen3-VL writes each frame group's time as text: give timestamp_tokens "
                           "(the tokenizer's encode, without special tokens)")
    ids: list[int] = []
    slots: list[VideoSlot] = []
    for g, seconds in enumerate(timestamps):  # transformers' Qwen3VLProcessor.replace_video_token
        ids.extend(int(x) for x in timestamp_tokens(f"<{seconds:.1f} seconds>"))
        ids.append(token_ids.vision_start_token_id)
        slots.append(VideoSlot(vid, at + len(ids), per, (1, h, w), per, g))
        ids.extend([pad] * per)
        ids.append(token_ids.vision_end_token_id)
    return ids, slots


def build_prompt(parts: Sequence[Sequence[int] | Any], token_ids: VisionTokenIds, *,
                 timestamp_tokens: Tokenize | None = None) -> VisionPrompt:
    """Concatenate text, images and videos in order.

    parts: each either a sequence of text token ids, or one image or video as answered by `encode` (an object
    or dict with `id`, `num_tokens`, `grid_thw`; a video's with `video_grid_thw`, `tokens_per_group` and its
    metadata). Every image becomes `vision_start, image_token x num_tokens, vision_end`, every video as its
    family's processor writes it (module docstring); Qwen3-VL's timestamps are tokenized by
    `timestamp_tokens` (the tokenizer's encode without special tokens).
    """
    ids: list[int] = []
    slots: list[Slot] = []
    for part in parts:
        if isinstance(part, (list, tuple, torch.Tensor)):
            ids.extend(int(t) for t in part)
            continue
        ids.append(token_ids.vision_start_token_id)
        if _is_video(part):
            video_ids, video_slots = _video_layout(part, token_ids, len(ids), timestamp_tokens)
            ids.extend(video_ids)
            slots.extend(video_slots)
        else:
            image_id, n, grid_thw = _image_fields(part)
            slots.append(ImageSlot(image_id, len(ids), n, grid_thw))
            ids.extend([token_ids.image_token_id] * n)
        ids.append(token_ids.vision_end_token_id)
    prompt = VisionPrompt(torch.tensor(ids, dtype=torch.long), tuple(slots), token_ids)
    _check_prompt(prompt)
    return prompt


def expand_image_pads(input_ids: Sequence[int] | torch.Tensor, images: Sequence[Any], token_ids: VisionTokenIds,
                      *, videos: Sequence[Any] = (), timestamp_tokens: Tokenize | None = None) -> VisionPrompt:
    """Expand a tokenized chat prompt that holds one `<|image_pad|>` per image (and one `<|video_pad|>` per
    video) to their placeholders, as the processor does."""
    flat = [int(t) for t in (input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids)]
    pad, video_pad = token_ids.image_token_id, token_ids.video_token_id
    if flat.count(pad) != len(images):
        raise InvalidInput(f"prompt has {flat.count(pad)} image pads but {len(images)} images were given")
    if videos and flat.count(video_pad) != len(videos):
        raise InvalidInput(f"prompt has {flat.count(video_pad)} video pads but {len(videos)} videos were given")
    ids: list[int] = []
    slots: list[Slot] = []
    pending, pending_videos = iter(images), iter(videos)
    for tok in flat:
        if tok == pad:
            image_id, n, grid_thw = _image_fields(next(pending))
            slots.append(ImageSlot(image_id, len(ids), n, grid_thw))
            ids.extend([pad] * n)
        elif videos and tok == video_pad:
            video_ids, video_slots = _video_layout(next(pending_videos), token_ids, len(ids), timestamp_tokens)
            ids.extend(video_ids)
            slots.extend(video_slots)
        else:
            ids.append(tok)
    prompt = VisionPrompt(torch.tensor(ids, dtype=torch.long), tuple(slots), token_ids)
    _check_prompt(prompt)
    return prompt


def _check_prompt(prompt: VisionPrompt) -> None:
    # transformers' rope index groups consecutive placeholders of one kind into one run, so two slots must
    # never touch; the vision_start / vision_end wrapping guarantees that. Check it instead of assuming it.
    ids, t = prompt.input_ids, prompt.token_ids
    pads = {t.image_token_id} | ({t.video_token_id} if t.video_token_id is not None else set())
    for slot in prompt.slots:
        if slot.num_tokens <= 0:
            raise InvalidInput(f"{slot.id} has num_tokens {slot.num_tokens}")
        touches = slot.offset == 0 or int(ids[slot.offset - 1]) in pads
        if touches or (slot.end < len(ids) and int(ids[slot.end]) in pads):
            raise InvalidInput(f"{slot.id} at {slot.offset} is not wrapped in vision_start/vision_end")
    expected = sum(slot.num_tokens for slot in prompt.slots)
    found = int(sum((ids == p).sum() for p in pads))
    if found != expected:
        raise InvalidInput(f"prompt holds {found} image and video tokens, the images and videos need {expected}")
