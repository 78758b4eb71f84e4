"""The steps an encode of images (image_encode.py) and an encode of videos (video_encode.py) share, each once:

  unique_items     one entry per id of the request, in order; one caller id sent with two contents in the
                   same request is a Conflict naming the item
  check_contents   an id never names two contents: each caller id is bound in Redis first (directory.py), then
                   its binding, its entry here and its flights here must all agree with the request's bytes
                   (Conflict, before anything is admitted: the request's failure, never the id's)
  pin_all          a pin on every key for its lease, all or none, after the caller's admission to the engine;
                   refused: the admission is undone, and the request is a 429 whose Retry-After is at least
                   the engine's backlog, or a 400 when the pins could never fit under --max-pinned-bytes
  wait_all         the rows of every item, within the request's timeout; a failure names its item
                   (`image 2: ...`), a caller that leaves leaves every item

`what` names the kind of item in messages: "image" or "video".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from encoder_service import errors, timeouts
from encoder_service.cache import CacheKey, EmbeddingStore, other_content
from encoder_service.core.flight import conflict
from encoder_service.engine.engine import Engine
from encoder_service.replicas import Replicas
from encoder_service.replicas.bindings import RETIRED

T = TypeVar("T")


class Item(Protocol):
    key: CacheKey
    content_tag: int


I = TypeVar("I", bound=Item)


def unique_items(items: Sequence[I], what: str) -> tuple[dict[str, I], dict[str, int]]:
    """(name -> the item, name -> where it first appears in the request, for error messages)."""
    unique: dict[str, I] = {}
    first_index: dict[str, int] = {}
    for i, item in enumerate(items):
        if other_content(item.content_tag, unique.setdefault(item.key.name, item).content_tag):
            raise conflict(item.key).prefixed(f"{what} {i}: ")  # one caller id for two contents of the request
        first_index.setdefault(item.key.name, i)
    return unique, first_index


async def check_contents(replicas: Replicas, callers: Mapping[str, tuple[CacheKey, CacheKey, int]],
                         local_tags: Callable[[str], Iterable[int]], first_index: Mapping[str, int],
                         what: str) -> None:
    """`callers`: name -> (the item's key, the key its binding is under: a video's is its frame group 0's,
    the request's content tag) of each caller id; `local_tags(name)`: the tags its entry and flights here
    carry (0: none). Redis first (one round trip: the first replica to bind an id decides what it names);
    what is here is read after it, and nothing is awaited from there until the items have joined their
    flights."""
    if not callers:
        return
    bound = await replicas.bind_tags({bound_under: tag for _, bound_under, tag in callers.values()})
    for name, (key, bound_under, tag) in callers.items():
        if bound.get(bound_under.name) == RETIRED:
            raise errors.Conflict(f"{what} {first_index[name]}: id {key.id!r} is retired: the shared Redis lost "
                                  "what it named while a replica held it, and it was then sent with other bytes; "
                                  "it names nothing now (send these bytes under another id)")
        if any(other_content(tag, recorded) for recorded in (bound.get(bound_under.name, 0), *local_tags(name))):
            raise conflict(key).prefixed(f"{what} {first_index[name]}: ")


def pin_all(store: EmbeddingStore, engine: Engine, pins: Mapping[str, Sequence[tuple[CacheKey, int]]],
            first_index: Mapping[str, int], what: str, undo_admission: Callable[[], None],
            hint_one: str) -> None:
    """Pin every key of every item (`pins`: name -> its (key, bytes to pin) pairs), all or none. Refused: the
    pins taken are given back, `undo_admission()` gives back the engine room, and it raises Overloaded
    (429; Retry-After no sooner than the engine's backlog drains: pins end as clients fetch the rows of
    images still to encode) or LimitExceeded (400) when they could never fit (`hint_one`: what to do about
    one item that alone is over --max-pinned-bytes)."""
    pinned: list[CacheKey] = []
    try:
        for keys in pins.values():
            for key, nbytes in keys:
                store.pin(key, nbytes=nbytes)
                pinned.append(key)
    except errors.Overloaded as exc:  # nothing of this request stays admitted or pinned
        undo_admission()
        for key in pinned:
            store.unpin(key)
        sizes = {name: sum(n for _, n in keys) for name, keys in pins.items()}
        never = _never_pinnable(sizes, store.local.max_pinned_bytes, first_index, what, hint_one)
        if never is not None:
            raise never from None
        exc.retry_after_s = max(exc.retry_after_s, engine.retry_after_s())
        raise


def _never_pinnable(sizes: Mapping[str, int], limit: int, first_index: Mapping[str, int], what: str,
                    hint_one: str) -> errors.LimitExceeded | None:
    """Why the pins could not be granted even with no other pin held (one item over --max-pinned-bytes, or
    all of them together), else None: they fit once other pins end (429)."""
    for name, nbytes in sizes.items():
        if nbytes > limit:
            return errors.LimitExceeded(f"{what} {first_index[name]}: embedding bytes to pin", nbytes,
                                        f"{limit} (--max-pinned-bytes)", hint=hint_one)
    total = sum(sizes.values())
    if total > limit:
        return errors.LimitExceeded(f"embedding bytes to pin for the request's {len(sizes)} {what}s", total,
                                    f"{limit} (--max-pinned-bytes)",
                                    hint="they can never be pinned together: send fewer per request")
    return None


async def wait_all(tasks: Mapping[str, Awaitable[T]], timeout_s: float | None, t0: float,
                   first_index: Mapping[str, int], what: str, leave: Callable[[], None]) -> dict[str, T]:
    """name -> what its task returned, once every one has, within `timeout_s` (None: no bound); a failure
    names its item; a caller that leaves (cancelled) leaves every item (`leave()`). The tasks are shared
    with other requests: shielded, never cancelled here."""

    async def one(name: str, task: Awaitable[T]) -> T:
        try:
            return await asyncio.shield(task)
        except errors.EncoderServiceError as exc:  # shared by the task's waiters: each gets its own copy
            raise exc.prefixed(f"{what} {first_index[name]}: ") from None

    try:
        done = await timeouts.gather_within(timeout_s, *(one(n, t) for n, t in tasks.items()))
    except TimeoutError:
        raise errors.DeadlineExceeded(
            f"encode did not finish within timeout_s={timeout_s} (waited {time.perf_counter() - t0:.3f}s)"
        ) from None
    except asyncio.CancelledError:
        leave()
        raise
    return dict(zip(tasks, done))
