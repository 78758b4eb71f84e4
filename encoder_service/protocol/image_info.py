"""What encode answers per image, on both ends: the HTTP JSON fields (`to_json` / `from_json`; the gRPC
ImageInfo message: grpc_messages.py, `info_to_proto` / `info_from_proto`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageInfo:  # answered once the header is read and sized, before the ViT runs
    id: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    row_width: int
    hidden_size: int
    layout: str
    dtype: str
    cached: bool
    # The replica that holds (or is making) the rows, as other replicas reach it (http://host:port), when
    # replicas share Redis: a client that can reach it fetches there directly (client/owners.py).
    owner: str | None = None

    def to_json(self) -> dict:
        """The answer's HTTP JSON object (grid_thw a list)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ImageInfo)}
        return fields | {"grid_thw": list(self.grid_thw)}

    @classmethod
    def from_json(cls, d: dict, **extra):
        """An answer from its HTTP JSON object (other keys, such as "embedding", are the caller's); `extra`
        fills a subclass's own fields."""
        fields = {f.name: d[f.name] for f in dataclasses.fields(ImageInfo) if f.name != "owner"} | {
            "owner": d.get("owner")}
        return cls(**fields | {"grid_thw": tuple(d["grid_thw"])}, **extra)
