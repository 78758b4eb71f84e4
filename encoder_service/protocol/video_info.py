"""What encode answers per video, on both ends: the HTTP JSON fields (`to_json` / `from_json`; the gRPC
VideoInfo message: grpc_messages.py, `video_info_to_proto` / `video_info_from_proto`), and the fetch items of
its frame groups.

A video's rows are `video_grid_thw[0]` frame groups of `tokens_per_group` rows each, group after group. Each
group is fetched (and cached) on its own, under its id `<id>#<g>` (`group_id`). Where the groups sit in the
prompt is the language model's layout:

  Qwen2-VL, Qwen2.5-VL  one run of `num_tokens` video placeholders: group g at offset + g * tokens_per_group
                        (`fetch_items(offset)`); M-RoPE needs `second_per_grid_t` (Qwen2.5-VL)
  Qwen3-VL              each group after its own timestamp text `<{t:.1f} seconds>` and vision start, before
                        its vision end: the groups' offsets are the caller's (`fetch_items(offsets=[...])`);
                        `group_timestamps` are the t's
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

GROUP_SEP = "#"  # cache/video_keys.py: a group's id is <video id>#<g>


@dataclass(frozen=True)
class VideoInfo:  # answered once the header is read and sized, before the ViT runs
    id: str
    video_grid_thw: tuple[int, int, int]  # (frame groups, patch rows, patch columns)
    num_tokens: int  # rows of the whole video
    tokens_per_group: int  # rows of one frame group: h * w / merge^2
    num_frames: int  # sampled frames (the last one repeated once more when odd)
    sampled_fps: float  # the sampled frames' rate (transformers' VideoMetadata.sampled_fps)
    second_per_grid_t: float | None  # Qwen2/2.5-VL: temporal_patch_size / sampled_fps; None for Qwen3-VL
    group_timestamps: tuple[float, ...] | None  # Qwen3-VL: each group's time in seconds; None for Qwen2/2.5
    row_width: int
    hidden_size: int
    layout: str
    dtype: str
    cached: bool  # every group was cached when encode answered
    owner: str | None = None  # image_info.py: ImageInfo.owner (the replica encoding the video)

    @property
    def num_groups(self) -> int:
        return self.video_grid_thw[0]

    def group_id(self, group: int) -> str:
        return f"{self.id}{GROUP_SEP}{group}"

    def fetch_items(self, offset: int | None = None, *, offsets: Sequence[int] | None = None
                    ) -> list[tuple[str, int, int]]:
        """(group id, offset, tokens_per_group) per frame group: the groups one after the other from `offset`
        (Qwen2/2.5-VL), or at their own `offsets` (Qwen3-VL: one per group)."""
        if (offset is None) == (offsets is None):
            raise ValueError("give offset (the groups in one run) or offsets (one per group)")
        if offsets is None:
            offsets = [offset + g * self.tokens_per_group for g in range(self.num_groups)]
        elif len(offsets) != self.num_groups:
            raise ValueError(f"{len(offsets)} offsets for {self.num_groups} frame groups")
        return [(self.group_id(g), int(at), self.tokens_per_group) for g, at in enumerate(offsets)]

    def to_json(self) -> dict:
        """The answer's HTTP JSON object (tuples as lists; the metadata another family has no use for: null)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(VideoInfo)}
        d["video_grid_thw"] = list(self.video_grid_thw)
        if self.group_timestamps is not None:
            d["group_timestamps"] = list(self.group_timestamps)
        return d

    @classmethod
    def from_json(cls, d: dict, **extra):
        """An answer from its HTTP JSON object; `extra` fills a subclass's own fields."""
        fields = {f.name: d[f.name] for f in dataclasses.fields(VideoInfo) if f.name != "owner"}
        fields["owner"] = d.get("owner")
        fields["video_grid_thw"] = tuple(d["video_grid_thw"])
        if d["group_timestamps"] is not None:
            fields["group_timestamps"] = tuple(d["group_timestamps"])
        return cls(**fields, **extra)
