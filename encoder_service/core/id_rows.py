"""Where one id's rows come from, for a fetch (core/encoder.py): its row count, then the rows of a segment.

In order: how the id's last encode here failed (raised), its flight (rows once it lands), a video's frame
group its driver has not reached yet (video_flights.py), the store, else the other replicas (the face:
replicas/face.py; shared, a row copy in Redis or the replica that holds them, peer to peer; should it be
gone, this replica encodes the image again from its kept bytes: take_over.py). How far a fetch reaches is
its destination's (core/fetch_destination.py): ANY (the above); HERE (a fetch by IPC: flights and the store,
never another replica); HELD (another replica's fetch: what the store holds now, at once, never a wait; an id
still encoding here is settled through Redis).
No rows anywhere: NotFound.
"""

from __future__ import annotations

import asyncio
import enum

import torch

from encoder_service import errors
from encoder_service import timeouts
from encoder_service.cache import CacheKey, EmbeddingStore, Entry
from encoder_service.cache.video_keys import is_video_id
from encoder_service.core.flight import Flights
from encoder_service.core.metrics import Metrics
from encoder_service.core.take_over import TakeOver
from encoder_service.core.video_flights import VideoFlights
from encoder_service.ranges import Segment
from encoder_service.replicas import Replicas


class Reach(enum.Enum):
    ANY = "any"
    HERE = "here"
    HELD = "held"


class IdRows:
    def __init__(self, store: EmbeddingStore, replicas: Replicas, take_over: TakeOver, flights: Flights,
                 video_flights: VideoFlights, metrics: Metrics):
        self.store, self.replicas, self.take_over = store, replicas, take_over
        self.flights, self.video_flights, self.metrics = flights, video_flights, metrics

    def encoding(self, key: CacheKey) -> bool:
        """Its rows are still being encoded here (a flight, or a frame group its video's driver is on)."""
        return key.name in self.flights or (is_video_id(key.id) and self.video_flights.encoding(key))

    def here(self, key: CacheKey) -> bool:
        """Its rows are here or being encoded here (no Redis round trip); the failure of its last encode here
        is raised."""
        self.flights.raise_failure(key)
        if is_video_id(key.id):
            self.video_flights.raise_failure(key)
        return self.encoding(key) or self.store.peek(key) is not None

    async def num_tokens(self, key: CacheKey, deadline: timeouts.Deadline, reach: Reach) -> int:
        """The id's row count: its flight's, else its entry's header (the store, else where Redis's directory
        says the rows are), else that of the rows another replica is encoding, once they land (no Redis round
        trip for ids known here)."""
        if reach is Reach.HELD:
            return self._held(key).num_rows
        self.flights.raise_failure(key)
        flight = self.flights.get(key.name)
        if flight is not None:
            return flight.num_tokens
        if is_video_id(key.id):  # a frame group its video's driver is on
            group_tokens = self.video_flights.group_tokens(key)
            if group_tokens is not None:
                return group_tokens
        if reach is Reach.HERE:
            entry = self.store.peek(key)
            if entry is None:
                raise errors.NotFound(f"id {key.id!r} is not held by this replica")
            return entry.num_rows
        header = await self.replicas.header(key)
        if header is None:  # another replica's encode: its rows once they land, or taken over here
            return await self.replicas.num_tokens_elsewhere(key, deadline, self.take_over)
        return header.num_rows

    async def rows(self, key: CacheKey, seg: Segment, reach: Reach) -> torch.Tensor:
        """The segment's rows [seg.row_start, seg.row_end) of the id: [n, row_width]."""
        if reach is Reach.HELD:
            rows = self._held(key).rows(seg.row_start, seg.row_end)
            self.metrics.cache_hits.labels(tier="local").inc()
            return rows
        frame_group = is_video_id(key.id)
        if frame_group:  # its video's driver may not have reached it yet
            await self.video_flights.started(key)
        tier = "local"
        with self.flights.waiting(key.name) as flight:
            if flight is not None:  # its fill may not have reached the store yet
                try:
                    landed = await asyncio.shield(flight.task)
                except errors.EncoderServiceError as exc:  # shared by the flight's waiters: each gets a copy
                    raise exc.prefixed(f"encode of id {key.id!r} failed: ") from None
                rows = landed.entry.rows(seg.row_start, seg.row_end)
            else:  # its flight may have failed since the chunk was sized from it: that failure answers
                self.flights.raise_failure(key)
                if frame_group:
                    self.video_flights.raise_failure(key)
                if reach is Reach.HERE:
                    entry = self.store.peek(key)
                    rows = entry.rows(seg.row_start, seg.row_end) if entry is not None else None
                else:
                    rows = self.store.rows(key, seg.row_start, seg.row_end)
                    if rows is None:  # another replica's (or a row copy in Redis, or encoded here again)
                        tier = "peer"
                        rows = await self.replicas.rows_elsewhere(key, seg.row_start, seg.row_end, self.take_over)
        if rows is None:
            raise errors.NotFound(f"unknown id {key.id!r}: evicted or its encode failed (encode it again)")
        self.metrics.cache_hits.labels(tier=tier).inc()
        return rows

    def _held(self, key: CacheKey) -> Entry:
        """The entry the local tier holds now, for another replica's fetch; NotFound at once otherwise."""
        entry = self.store.peek(key)
        if entry is None:
            raise errors.NotFound(f"id {key.id!r} is not held by this replica now (asked by another one: it answers "
                                  "only rows it holds, at once; one still encoding here is settled through Redis)")
        return entry
