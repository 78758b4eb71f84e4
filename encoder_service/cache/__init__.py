"""Per-image embedding cache: keys (keys.py), the stored format (entry.py), the host LRU with leases
(local.py), and the store that ties them together (store.py)."""

from encoder_service.cache.entry import CorruptEntry, Entry, EntryHeader
from encoder_service.cache.keys import (
    CacheKey, caller_key, content_tag, key_from_id, make_key, model_fingerprint, other_content,
)  # fmt: skip
from encoder_service.cache.store import EmbeddingStore

__all__ = [
    "CacheKey", "CorruptEntry", "EmbeddingStore", "Entry", "EntryHeader",
    "caller_key", "content_tag", "key_from_id", "make_key", "model_fingerprint", "other_content",
]  # fmt: skip
