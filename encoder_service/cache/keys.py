"""Cache keys: what an embedding is stored under.

A key has two parts:
  - the *id* a client sees: the hex content hash of the raw encoded image bytes (so a hit needs no
    decode), or a caller-supplied id prefixed with `u:` (hex has no `:`, so the two namespaces can
    never collide);
  - a *model fingerprint*: a hash of everything the embedding values depend on (checkpoint identity,
    family, dtype, preprocessing settings and backend, whether EXIF orientation is applied, NUMERICS_VERSION).
    It namespaces the Redis key, so replicas of another model, dtype, setting or numerics version sharing one
    Redis never read each other's rows.

Full key (Redis and local tier): `encsvc:<model_fp>:{c:<algo>:<hex>}` or `encsvc:<model_fp>:{u:<caller id>}`.
The braces are a Redis Cluster hash tag: Redis hashes only what is between them, so every name the replicas
keep for one id (directory.py: its location, marker, input and binding beside its entry) falls in one hash
slot, on one node, and a pipeline or script over them never crosses slots; ids spread over every node. Caller
ids hold no braces, so the first `}` closes the tag.

A caller id must never name two contents: the `content_tag` of the bytes it was first encoded from goes
with its entry (entry.py's header, so every replica reading it knows), its flight and its pending marker;
an encode of the same id with other bytes is a Conflict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import xxhash

from encoder_service import NUMERICS_VERSION
from encoder_service.errors import InvalidInput

HASH_ALGOS = ("blake3", "xxh3_128", "sha256")
KEY_PREFIX = "encsvc"
CALLER_PREFIX = "u:"
# Caller ids: printable, no whitespace, no braces (they would end the Cluster hash tag), bounded so keys stay short.
_CALLER_ID_RE = re.compile(r"^[A-Za-z0-9._:/@+=\-]{1,128}$")
_CONTENT_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def content_hash(data: bytes | memoryview, algo: str = "blake3") -> str:
    """128-bit hex digest of the raw encoded bytes (32 chars, whichever algorithm)."""
    if algo == "blake3":
        # Big inputs: blake3 hashes on several threads and releases the GIL; small ones are not worth it.
        threads = blake3.blake3.AUTO if len(data) >= 1 << 20 else 1
        return blake3.blake3(data, max_threads=threads).hexdigest(length=16)
    if algo == "xxh3_128":
        return xxhash.xxh3_128_hexdigest(data)
    if algo == "sha256":
        return hashlib.sha256(data).hexdigest()[:32]
    raise InvalidInput(f"hash algorithm is {algo!r}, expected one of {', '.join(HASH_ALGOS)}")


def content_tag(data: bytes | memoryview) -> int:
    """64-bit tag of an image's encoded bytes (xxh3_64, never 0: 0 means "not recorded")."""
    return xxhash.xxh3_64_intdigest(data) or 1


def other_content(tag: int, recorded: int) -> bool:
    """Whether `tag` and a `recorded` one say two different contents (0, not recorded, conflicts with none)."""
    return tag != 0 and recorded != 0 and tag != recorded


def _canonical(value: Any) -> Any:
    """JSON-able, order-stable form of preprocessing settings (dataclass, mapping, tuples)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # torch.dtype and friends


def model_fingerprint(
    checkpoint_fp: str,
    family: str,
    dtype: Any,
    preprocess: Any,
    *,
    layout: str = "",
    preprocess_backend: str = "pil",
    exif_orientation: bool = False,
    numerics_version: int = NUMERICS_VERSION,
) -> str:
    """Hash (24 hex chars) of everything an embedding's values depend on besides the image bytes.

    `checkpoint_fp` is `LoadedModel.fingerprint`; `preprocess` is the `PreprocessConfig` (or a dict
    of min/max pixels, mean/std, patch/merge sizes...); `dtype` a torch.dtype or its name;
    `preprocess_backend` the backend's `fingerprint` (preprocessing/backends.py: which processor, and for
    torchvision its resize recipe and decoder); `exif_orientation` whether images are turned upright by their
    EXIF orientation first (settings: --exif-orientation, the service's default).
    """
    fields = {
        "checkpoint": checkpoint_fp,
        "family": family,
        "dtype": str(dtype).removeprefix("torch."),
        "preprocess": _canonical(preprocess),
        "layout": layout,
        "numerics": numerics_version,
    }
    # pil is what every key was made with before there were backends: left out, its fingerprints (and the
    # rows a shared Redis holds under them) stay valid.
    if preprocess_backend != "pil":
        fields["preprocess_backend"] = preprocess_backend
    # Likewise the orientation: rows from before it was applied (False) keep their fingerprint, and so reach
    # only replicas that still ignore it (--no-exif-orientation).
    if exif_orientation:
        fields["exif_orientation"] = True
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return blake3.blake3(blob).hexdigest(length=12)


@dataclass(frozen=True)
class CacheKey:
    """`id`: what clients see and send back; `name`: the full key in Redis and the local tier."""

    id: str
    name: str

    def __str__(self) -> str:
        return self.name


def make_key(data: bytes | memoryview, model_fp: str, algo: str = "blake3") -> CacheKey:
    """Key of an image given as raw encoded bytes."""
    digest = content_hash(data, algo)
    return CacheKey(id=digest, name=f"{KEY_PREFIX}:{model_fp}:{{c:{algo}:{digest}}}")


def caller_key(caller_id: str, model_fp: str) -> CacheKey:
    """Key of a caller-supplied id: its own namespace (`u:`), so it cannot shadow a content key."""
    if not isinstance(caller_id, str) or not _CALLER_ID_RE.match(caller_id):
        raise InvalidInput(
            f"caller id {caller_id!r:.80} is invalid: 1-128 chars of letters, digits and ._:/@+=- "
            "(no spaces or braces)"
        )
    public = CALLER_PREFIX + caller_id
    return CacheKey(id=public, name=f"{KEY_PREFIX}:{model_fp}:{{u:{caller_id}}}")


def key_from_id(public_id: str, model_fp: str, algo: str = "blake3") -> CacheKey:
    """Resolve an id a client sent back (from an `encode` answer) to its key. InvalidInput if malformed:
    no encode answered it (a well-formed id that is not cached is NotFound where it is looked up)."""
    if public_id.startswith(CALLER_PREFIX):
        try:
            return caller_key(public_id[len(CALLER_PREFIX) :], model_fp)
        except InvalidInput as exc:
            raise InvalidInput(f"malformed id {public_id!r:.80}: {exc.message}") from None
    if not _CONTENT_ID_RE.match(public_id):
        raise InvalidInput(f"malformed id {public_id!r:.80}: not a 32-hex-digit content id or u:<caller id>")
    return CacheKey(id=public_id, name=f"{KEY_PREFIX}:{model_fp}:{{c:{algo}:{public_id}}}")
