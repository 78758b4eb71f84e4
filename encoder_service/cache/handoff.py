"""Handoff of an id between replicas sharing one Redis: what a fetch on replica B waits on while replica A
encodes the image it accepted.

Behind one Service an LLM server's `encode` and its `fetch` land on different replicas, and the rows of a
no-wait encode reach Redis only after the ViT ran and the write-behind queue got to them. So:

  - A, when it accepts an id (before it answers `encode`), SETs a small *pending marker* next to the entry
    (`RedisTier.mark_pending`), with a TTL of the encode's lease: an encode not done within its lease is
    abandoned (the engine drops it), and a crashed A cannot make others wait longer than that. A caller id's
    marker carries the content tag of its bytes (`pending <16 hex>`; keys.py: content_tag), as its entry's
    header will: a replica asked to encode the id with other bytes meanwhile sees the conflict
    (`RedisTier.content_tags`).
  - A settles the marker and then PUBLISHes the outcome on a channel of the marker's name, always in that
    order (state first, message second):
      landed  the rows' SET succeeded: DEL marker, PUBLISH "landed";
      failed  the encode failed, or its rows could not be stored (write-behind queue full, Redis full):
              SET marker "failed <kind> <message>" with a short TTL (under OOM, where SET is refused: DEL it),
              then PUBLISH the same value.
  - B (`RedisTier.wait_for`) checks [EXISTS entry, GET marker, PTTL marker]; only when the marker says
    pending does it SUBSCRIBE (one shared connection, subscriber.py), wait for Redis to confirm, and check
    again: an outcome published between the first check and the subscription is then visible as state,
    and one published after it arrives as a message. No polling: B sleeps on a future the message
    resolves, until its deadline or the marker's expiry at the latest (then it checks once more).

B's outcomes (`Settled`): LANDED (read the rows now), NOT_PENDING (nobody accepted it, or its marker
expired: the caller answers 404), TIMED_OUT (the caller's timeout), UNAVAILABLE (Redis down or lost
during the wait: the caller answers at once instead of hanging). A failure is raised as `EncodeFailed`,
with the kind A answered (a decode error stays a 400 on B), so B does not answer 404 for it.

Why "not stored" is a failure and not a fallback: B has only the id, not the image bytes, so it cannot
encode the image itself; the useful answer is at once and says why ("encode it again"), as a 404.

Where it stays best effort: A's outcome messages go through its write-behind queue (after the writes
queued before them), and a message A cannot send (Redis down, an error) is dropped: B then waits until its
own timeout or the marker's expiry, whichever comes first, never longer. Two replicas encoding the same
id share one marker: the first outcome settles it for both. A marker is a small key: an allkeys-lru Redis
may evict it, and B then answers 404 as it did without markers.

Names: the marker of entry `encsvc:<fp>:<c|u>:<rest>` is `encsvc:<fp>:pending:<c|u>:<rest>` (no entry
name has `pending` in the third place, so the two never collide, and no braces), and its channel is the
same string (Redis keeps channel names apart from key names). Names outside that scheme (tests) get
`<name>:pending`.
"""

from __future__ import annotations

import asyncio
import enum

from encoder_service.cache.keys import KEY_PREFIX
from encoder_service.errors import EncoderServiceError

PENDING = b"pending"
LANDED = b"landed"
_FAILED = b"failed"
_MAX_MESSAGE_BYTES = 240  # a marker is small: the kind and the start of the message are enough
NOT_STORED = "not_stored"  # the failure kind of rows that were encoded but could not be written


class Settled(enum.Enum):
    LANDED = "landed"
    NOT_PENDING = "not_pending"
    TIMED_OUT = "timed_out"
    UNAVAILABLE = "unavailable"


class EncodeFailed(EncoderServiceError):
    """The encode of an id failed on the replica that accepted it; `kind` is the kind that replica
    answered (mapped to a status the same way), `not_found` for rows that could not be stored."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def marker_name(name: str) -> str:
    prefix, sep, rest = name.partition(":")
    fp, sep2, tail = rest.partition(":")
    if prefix == KEY_PREFIX and sep and sep2:
        return f"{KEY_PREFIX}:{fp}:pending:{tail}"
    return f"{name}:pending"


def pending_value(content_tag: int = 0) -> bytes:
    """A pending marker's value: `pending`, with the content tag of a caller id's bytes when recorded."""
    return PENDING + b" %016x" % content_tag if content_tag else PENDING


def is_pending(value: bytes | None) -> bool:
    return value is not None and (value == PENDING or value.startswith(PENDING + b" "))


def pending_tag(value: bytes | None) -> int:
    """The content tag a pending marker carries; 0 when none (or not a pending marker)."""
    if not is_pending(value) or value == PENDING:
        return 0
    try:
        return int(value[len(PENDING) + 1:], 16)
    except ValueError:
        return 0


def failure_value(kind: str, message: str) -> bytes:
    """`failed <kind> <message>`: the marker value and the message of a failure (bounded in size)."""
    kind = kind if kind.isidentifier() and len(kind) <= 32 else "internal"
    text = message.encode("utf-8", "replace")[:_MAX_MESSAGE_BYTES]
    return b" ".join((_FAILED, kind.encode(), text))


def failure_of(exc: BaseException) -> bytes:
    if isinstance(exc, EncoderServiceError):
        return failure_value(exc.kind, exc.message)
    if isinstance(exc, asyncio.CancelledError):  # dropped before it ran: nothing to wait for, nothing wrong
        return failure_value("not_found", "its encode was dropped before it ran (every caller left)")
    return failure_value("internal", f"{type(exc).__name__} on the encoding replica")


def raise_if_failed(value: bytes | None, label: str) -> None:
    """Raise `EncodeFailed` when `value` (a marker value or a message) is a failure; `label` names the id."""
    if value is None or not value.startswith(_FAILED + b" "):
        return
    _, kind, text = (value.split(b" ", 2) + [b""])[:3]
    message = text.decode("utf-8", "replace")
    kind = kind.decode("ascii", "replace")
    if kind == NOT_STORED:
        raise EncodeFailed(f"id {label!r} was encoded on another replica, but {message} (encode it again)",
                           "not_found")
    raise EncodeFailed(f"encode of id {label!r} failed on another replica: {message}", kind)
