"""The shared-memory fetch target both ends agree on (writer: core/shm_writer.py; files: client/shm.py).

A co-located client creates a file `<shm dir>/encoder-fetch-<32 hex>` (mode 0600, sized up front) and names
it in a fetch as `ShmTarget(name, offset, by_position)`; the server writes the chunk's rows into it and
answers only the wire header. Where the rows go (`row_bytes` = row_width x dtype size):
  - packed (by_position false): exactly the wire payload, segment after segment, from `offset`;
  - by_position: segment rows at `offset + (position - start) * row_bytes`, as into a fetch `out` buffer
    (the client's own tensor in the file: no copy on its side); rows between segments untouched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from encoder_service.ranges import Segment

DEFAULT_DIR = "/dev/shm"  # the server's --shm-dir and the client's shm_dir: they must name one directory
PREFIX = "encoder-fetch-"
NAME_RE = re.compile(rf"^{PREFIX}[0-9a-f]{{32}}$")  # a bare file name: no directories, no other files


@dataclass(frozen=True)
class ShmTarget:
    name: str  # encoder-fetch-<32 hex>, a file directly in the server's shm dir
    offset: int  # byte offset of the first row (packed) or of row `start` (by_position)
    by_position: bool = False


def placements(segments: list[Segment], start: int, row_bytes: int, by_position: bool) -> list[tuple[int, int]]:
    """(byte offset from the target offset, byte length) of each segment's rows, in segment order."""
    out, packed = [], 0
    for s in segments:
        n = s.num_rows * row_bytes
        out.append(((s.position - start) * row_bytes if by_position else packed, n))
        packed += n
    return out
