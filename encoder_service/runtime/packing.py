"""Packs a batch of images into patch-token buckets (one captured CUDA graph each).

Greedy first-fit decreasing: images, largest first, go into the first open bin with room (a bin holds at most
the largest bucket's patches and `max_segments` attention segments, the frames a graph holds); each bin then
takes the smallest bucket that holds its patches. Within a bin the images keep their input order, and the
runner puts every image's output back at its input position, so the caller sees the original order. An image
larger than the largest bucket (or of more segments than max_segments) gets a bin of its own with
`bucket=None`: the runner runs it eagerly.

Pure python on ints: no tensors, no device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PackedBatch:
    indices: tuple[int, ...]  # input positions of the images, ascending (the order inside the batch)
    patches: int  # sum of their patch counts
    segments: int  # sum of their attention segments (one per temporal slice)
    bucket: int | None  # padded patch count of the graph to replay; None: run eagerly

    @property
    def padding(self) -> int:
        return 0 if self.bucket is None else self.bucket - self.patches


def pack(
    patches: Sequence[int],
    buckets: Sequence[int],
    *,
    segments: Sequence[int] | None = None,
    max_segments: int | None = None,
) -> list[PackedBatch]:
    """Plan the graph replays for images of `patches[i]` patch rows (and `segments[i]` attention segments,
    default 1 each). `max_segments`: the most segments one batch may hold (default: no limit); an image with
    more runs eagerly.

    Returns the batches ordered by their first input index. Every input index appears exactly once.
    """
    n = len(patches)
    segs = list(segments) if segments is not None else [1] * n
    if len(segs) != n:
        raise ValueError(f"{n} patch counts but {len(segs)} segment counts")
    for i, p in enumerate(patches):
        if p <= 0:
            raise ValueError(f"image {i} has {p} patches")
    buckets = sorted(set(int(b) for b in buckets))
    if not buckets:
        return [PackedBatch((i,), patches[i], segs[i], None) for i in range(n)]
    largest = buckets[-1]
    cap_segments = max_segments if max_segments is not None else 1 << 62

    bins: list[list[int]] = []  # image indices
    bin_patches: list[int] = []
    bin_segments: list[int] = []
    eager: list[int] = []
    # Largest first (ties: input order) so big images are placed while bins are empty.
    for i in sorted(range(n), key=lambda i: (-patches[i], i)):
        p, s = patches[i], segs[i]
        if p > largest or s > cap_segments:
            eager.append(i)
            continue
        for b in range(len(bins)):
            if bin_patches[b] + p <= largest and bin_segments[b] + s <= cap_segments:
                bins[b].append(i)
                bin_patches[b] += p
                bin_segments[b] += s
                break
        else:
            bins.append([i])
            bin_patches.append(p)
            bin_segments.append(s)

    out: list[PackedBatch] = []
    for idx, p, s in zip(bins, bin_patches, bin_segments):
        bucket = next(b for b in buckets if b >= p)
        out.append(PackedBatch(tuple(sorted(idx)), p, s, bucket))
    out.extend(PackedBatch((i,), patches[i], segs[i], None) for i in eager)
    out.sort(key=lambda pb: pb.indices[0])
    return out
