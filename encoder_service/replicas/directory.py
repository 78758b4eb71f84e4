"""Replicas of an id between replicas sharing one Redis: who encodes an accepted image, and what a fetch on
another replica waits on meanwhile.

Behind one Service an LLM server's `encode` and its `fetch` land on different replicas, two replicas may be
asked for the same new image at once, and a replica may die (or lose Redis) mid-encode. So, per id:

  - A *claim*: the replica that accepts an id (before it answers `encode`) SETs a small *pending marker*
    next to the entry with NX (pending.py: `mark_pending`): `pending <content tag: 16 hex> <owner>`. The first
    replica to set it encodes the image; one that finds another owner's marker does not encode it too, it
    waits for that replica's rows (core/flight.py). A caller id's marker carries the content tag of its
    bytes (keys.py: content_tag), as its entry's header will (the binding below, not the marker, decides a
    conflict; replicas before the binding read it from the marker, so it stays in the format).
  - A caller id's *binding*: before a replica admits anything of an encode with caller ids, it binds each id
    to the content tag of its bytes (binding_writes.py: `bind_tags`, one script per id: bindings.py): the first
    replica to bind an id decides what it names, on every replica, and where Redis lost the binding the tag
    the id's location or marker carries decides; every other replica asked for the id with other bytes
    answers Conflict (409) before admitting anything, so it claims nothing and keeps no bytes. A binding
    outlives the id's rows (the Redis TTL backstop, refreshed by each use), and the replicas holding an id
    write its binding again when Redis lost it (restart, eviction); an id found bound to other bytes by its
    holder is retired (bindings.py).
  - Liveness: the marker lives `pending_ttl_s` (a few seconds) and its owner renews it every heartbeat while
    it encodes the image or writes its rows (until their lease ends at the latest). A replica that dies or
    loses Redis stops renewing: its markers expire within seconds, and whoever waits learns that the owner
    is gone.
  - The *input*: beside the marker, under `input_name`, the image's bytes (bounded: one image is at most
    --max-image-bytes, a replica keeps at most `max_input_bytes` of them there, each for the encode's lease
    at most), so that whoever waits can encode the image itself once its owner is gone: a fetch of an id any
    replica accepted is answered as long as one replica lives.
  - The owner settles the marker and then PUBLISHes the outcome on a channel of the marker's name, always in
    that order (state first, message second):
      landed    the rows' SET succeeded: DEL marker and input, PUBLISH "landed";
      failed    the encode failed (the image's fault, e.g. it does not decode), or its rows could not be
                stored (write-behind backlog full, Redis full): SET marker "failed <kind> <message>" with a
                short TTL (under OOM, where SET is refused: DEL it), DEL input, PUBLISH the same value;
      released  the owner gives the image up without a verdict on it (it is shutting down, its engine
                died): DEL marker, keep the input, PUBLISH "released": a waiter takes it over at once.
  - A waiter (pending.py: `wait_for`) checks [EXISTS entry, GET marker, PTTL marker, STRLEN input]; only when
    the marker says pending does it SUBSCRIBE (one shared connection, subscriber.py), wait for Redis to
    confirm, and check again: an outcome published between the first check and the subscription is then
    visible as state, and one published after it arrives as a message. No polling: it sleeps on a future
    the message resolves, until its deadline or the marker's expiry at the latest (then it checks again: a
    live owner has renewed it meanwhile).

A waiter's outcomes (`Settled`): LANDED (read the rows now), ORPHANED (no marker, but the input is there:
its owner died, stalled past the marker's TTL or released it; encode it here, claiming it first),
NOT_PENDING (no rows, no marker, no input: nobody accepted it, its input was not kept, or it was evicted;
404), TIMED_OUT (the caller's timeout), UNAVAILABLE (Redis down or lost during the wait, or it came back
moments ago and other replicas may not have renewed their markers yet: the caller answers 503 at once, and
the project's clients retry within their deadline). A failure is raised as `EncodeFailed`, with the kind the
owner answered (a decode error stays a 400 elsewhere), so nobody answers 404 for it.

Where it stays best effort: an owner whose Redis is down keeps its claims and rows (a bounded backlog,
write_behind.py) and writes them once Redis is back; a waiter elsewhere may take the image over meanwhile,
and both encode it (correct, the work done twice). A marker is a small key: an allkeys-lru Redis may evict
it, and a waiter then takes the image over (input still there) or answers 404 as it did without markers.

Names: the marker of entry `encsvc:<fp>:{<c|u>:<rest>}` is `encsvc:<fp>:pending:{<c|u>:<rest>}`, its input
`encsvc:<fp>:input:{...}`, its location `encsvc:<fp>:at:{...}` and a caller id's binding `encsvc:<fp>:tag:{u:...}`
(no entry name has `pending`, `input`, `at` or `tag` in the third place, so they never collide); the braces are
the id's Redis Cluster hash tag (keys.py), so all of an id's names share one slot. The marker's channel is the
same string as the marker (Redis keeps channel names apart from key names). Names outside that scheme (tests) get
`{<name>}:pending` and the like.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from encoder_service.cache.entry import HEADER_LEN
from encoder_service.cache.keys import KEY_PREFIX
from encoder_service.errors import DeadlineExceeded, EncoderServiceError, Unavailable

PENDING = b"pending"
LANDED = b"landed"
RELEASED = b"released"
_FAILED = b"failed"
_MAX_MESSAGE_BYTES = 240  # a marker is small: the kind and the start of the message are enough
NOT_STORED = "not_stored"  # the failure kind of rows that were encoded but could not be written


class Settled(enum.Enum):
    LANDED = "landed"
    ORPHANED = "orphaned"
    NOT_PENDING = "not_pending"
    TIMED_OUT = "timed_out"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Marked:
    """What marking ids pending did: `ok` when the markers were written now (else they are written once Redis
    is back, if the replica still encodes them); `elsewhere`: the names another live replica had claimed
    already (it encodes them: wait for its rows rather than encode them too). True when `ok`."""

    ok: bool
    elsewhere: frozenset[str] = field(default_factory=frozenset)

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Located:
    """Where an id's rows are, from the directory: `header` (size, grid, content tag: the entry's, without
    its rows); `owner`, the replica that wrote them ("" when only a row copy in Redis says so), and `url`,
    its advertised address while it lives (None: gone, this replica itself or one advertising this one's
    address, or it advertises none); `copy`: a copy of the rows is in Redis too (read them with GETRANGE);
    `block_sums`: the rows' block checksums, whose digest is the header's (b"": not recorded)."""

    header: object  # entry.py: EntryHeader
    owner: str
    url: str | None
    copy: bool
    block_sums: bytes = b""


class EncodeFailed(EncoderServiceError):
    """The encode of an id failed on the replica that accepted it; `kind` is the kind that replica
    answered (mapped to a status the same way), `not_found` for rows that could not be stored."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _scheme_name(name: str, part: str) -> str:
    """`encsvc:<fp>:<part>:{<id>}` beside entry `encsvc:<fp>:{<id>}` (the same hash tag: one Cluster slot);
    names outside that scheme (tests) get `{<name>}:<part>` (their hash tag: the slot of `<name>`)."""
    prefix, sep, rest = name.partition(":")
    fp, sep2, tail = rest.partition(":")
    if prefix == KEY_PREFIX and sep and sep2 and tail.startswith("{"):
        return f"{KEY_PREFIX}:{fp}:{part}:{tail}"
    return f"{{{name}}}:{part}" if "{" not in name else f"{name}:{part}"


def marker_name(name: str) -> str:
    return _scheme_name(name, "pending")


def input_name(name: str) -> str:
    return _scheme_name(name, "input")


def location_name(name: str) -> str:
    """Where an id's rows are: the replica that holds them and their entry header (`location_value`)."""
    return _scheme_name(name, "at")


def location_value(owner: str, header: bytes, block_sums: bytes) -> bytes:
    """`<owner> <the entry's raw header><its block checksums>`: who holds the rows, what they are (size, grid,
    content tag) and what they must hash to (the entry's trailer, whose digest the header carries: a replica
    checks the rows another one sends against it, cache/entry.py: verify_rows)."""
    return owner.encode("ascii") + b" " + header + block_sums


def parse_location(value: bytes | None) -> tuple[str, bytes, bytes] | None:
    """(owner, raw header, block checksums) of a location value; None when there is none (or it is not one).
    No checksums (b""): written by a replica before they were (its rows are not checked)."""
    if not value:
        return None
    owner, sep, rest = value.partition(b" ")
    return (owner.decode("ascii", "replace"), rest[:HEADER_LEN], rest[HEADER_LEN:]) if sep and owner else None


def replica_name(owner: str) -> str:
    """A live replica's address for its peers (the value: its advertised URL), renewed by its heartbeat."""
    return f"{KEY_PREFIX}:replica:{owner}"


def binding_name(name: str) -> str:
    """Where a caller id's binding to one content lives: the content tag of the bytes it was first accepted
    with (16 hex), first come first served across replicas (binding_writes.py: bind_tags)."""
    return _scheme_name(name, "tag")


def binding_value(content_tag: int) -> bytes:
    return b"%016x" % content_tag


def pending_value(content_tag: int = 0, owner: str = "") -> bytes:
    """A pending marker's value: `pending <tag> <owner>` (the tag of a caller id's bytes, 0 when none)."""
    return b"%s %016x %s" % (PENDING, content_tag, owner.encode()) if owner else PENDING + b" %016x" % content_tag


def is_pending(value: bytes | None) -> bool:
    return value is not None and (value == PENDING or value.startswith(PENDING + b" "))


def pending_owner(value: bytes | None) -> str:
    """The owner a pending marker names; "" when none (or not a pending marker)."""
    parts = value.split(b" ") if is_pending(value) else []
    return parts[2].decode("ascii", "replace") if len(parts) > 2 else ""


def failure_value(kind: str, message: str) -> bytes:
    """`failed <kind> <message>`: the marker value and the message of a failure (bounded in size)."""
    kind = kind if kind.isidentifier() and len(kind) <= 32 else "internal"
    text = message.encode("utf-8", "replace")[:_MAX_MESSAGE_BYTES]
    return b" ".join((_FAILED, kind.encode(), text))


def outcome_of(exc: BaseException) -> bytes:
    """How an owner settles an encode that ended with `exc`: RELEASED when the fault is the owner's own, not
    the image's (it is shutting down, its engine or a batch failed, it timed out waiting: another replica can
    do better), else the failure."""
    if isinstance(exc, (Unavailable, DeadlineExceeded)):
        return RELEASED
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
