"""Cache keys of videos and of their frame groups.

A video's rows are cached per frame group: each group is its own entry, under the video's key name with
`#<g>` after it, so a fetch reads only the groups its chunk overlaps. Ids, in their own namespace (`v:`), so
that a video id never names an image nor the other way round:

    video   v:<32 hex>          content digest of the video (its file's bytes, or each frame's) and of the
                                options it was sampled and sized with (fps, num_frames, pixels, ...)
            v:u:<caller id>     a caller's id for it (the id names that content: other bytes or options 409)
    group   <video id>#<g>      frame group g (0-based): what fetch and release take

Full names: `encsvc:<video_fp>:{v:c:<algo>:<hex>}#<g>` and `encsvc:<video_fp>:{v:u:<caller id>}#<g>` (the
video's hash tag: a Redis Cluster keeps every group of one video on one node, keys.py). The
fingerprint `video_fp` is the model's with the video preprocessing (the checkpoint's video processor settings,
the device kind the frames are resized on) instead of the image backend's: rows of a video and of an image
never share a key. `#` is in neither hex digests nor caller ids, so a group id parses one way only.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping

import blake3
import xxhash

from encoder_service.cache.keys import CALLER_PREFIX, HASH_ALGOS, KEY_PREFIX, CacheKey, caller_key
from encoder_service.errors import InvalidInput

VIDEO_PREFIX = "v:"
GROUP_SEP = "#"
_CONTENT_RE = re.compile(r"^[0-9a-f]{32}$")
_GROUP_RE = re.compile(r"^(0|[1-9][0-9]{0,5})$")


def _hasher(algo: str):
    if algo == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise InvalidInput(f"hash algorithm is {algo!r}, expected one of {', '.join(HASH_ALGOS)}")


def _stream(parts: Iterable[bytes | memoryview], options: Mapping) -> Iterable[bytes | memoryview]:
    """What a video's digest and tag cover: its options (canonical JSON), then each part (the file, or each
    frame image) preceded by its length, so that no two (options, parts) give the same stream."""
    yield json.dumps(dict(options), sort_keys=True, separators=(",", ":")).encode() + b"\0"
    for part in parts:
        yield len(part).to_bytes(8, "little")
        yield part


def video_key(parts: Iterable[bytes | memoryview], options: Mapping, video_fp: str, algo: str = "blake3") -> CacheKey:
    """Key of a video given as its file (one part) or its frames (one part each), sampled with `options`."""
    hasher = _hasher(algo)
    for piece in _stream(parts, options):
        hasher.update(piece)
    # 128 bits in 32 hex digits, whichever algorithm (as cache/keys.py: content_hash)
    digest = hasher.hexdigest(length=16) if algo == "blake3" else hasher.hexdigest()[:32]
    return CacheKey(id=f"{VIDEO_PREFIX}{digest}", name=f"{KEY_PREFIX}:{video_fp}:{{v:c:{algo}:{digest}}}")


def video_tag(parts: Iterable[bytes | memoryview], options: Mapping) -> int:
    """64-bit content tag of a video and its options (cache/keys.py: content_tag; never 0)."""
    hasher = xxhash.xxh3_64()
    for piece in _stream(parts, options):
        hasher.update(piece)
    return hasher.intdigest() or 1


def video_caller_key(caller_id: str, video_fp: str) -> CacheKey:
    """Key of a caller's id for a video (InvalidInput when malformed, as for images)."""
    image = caller_key(caller_id, video_fp)  # the same rules for the id itself
    return CacheKey(id=VIDEO_PREFIX + image.id, name=f"{KEY_PREFIX}:{video_fp}:{{v:u:{caller_id}}}")


def group_key(video: CacheKey, group: int) -> CacheKey:
    """Key of frame group `group` of `video`."""
    return CacheKey(id=f"{video.id}{GROUP_SEP}{group}", name=f"{video.name}{GROUP_SEP}{group}")


def is_video_id(public_id: str) -> bool:
    return public_id.startswith(VIDEO_PREFIX)


def video_key_from_id(public_id: str, video_fp: str, algo: str = "blake3") -> tuple[CacheKey, int | None]:
    """(the video's key, its group index or None) of a video or group id a client sent back. InvalidInput when
    malformed (a well-formed one not known is NotFound where it is looked up)."""
    video_id, sep, group = public_id.partition(GROUP_SEP)
    if sep and not _GROUP_RE.match(group):
        raise InvalidInput(f"malformed id {public_id!r:.80}: a frame group is <video id>#<group>, group a "
                           "decimal number")
    body = video_id[len(VIDEO_PREFIX):]
    if body.startswith(CALLER_PREFIX):
        try:
            key = video_caller_key(body[len(CALLER_PREFIX):], video_fp)
        except InvalidInput as exc:
            raise InvalidInput(f"malformed id {public_id!r:.80}: {exc.message}") from None
    elif _CONTENT_RE.match(body):
        key = CacheKey(id=video_id, name=f"{KEY_PREFIX}:{video_fp}:{{v:c:{algo}:{body}}}")
    else:
        raise InvalidInput(f"malformed id {public_id!r:.80}: a video id is v:<32 hex digits> or v:u:<caller id>")
    return key, int(group) if sep else None
