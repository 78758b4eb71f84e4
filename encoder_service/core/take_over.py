"""The take-over of an image whose accepting replica is gone: encoded here from the bytes it kept in Redis,
accepted as this replica's own encode would accept it (probe, queue room, a pin for the lease), in a flight
that claims it first (so it is encoded once across replicas). What needs the core's own machinery (its
flights, the engine's admission, the image reader); the face (replicas/shared.py) calls it when a fetch
finds an id's replica gone (replicas/face.py: TakeOver)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import torch

from encoder_service import errors
from encoder_service.cache import CacheKey, EmbeddingStore, other_content
from encoder_service.cache.keys import CALLER_PREFIX
from encoder_service.core.flight import Flight, Flights
from encoder_service.core.images import ImageReader
from encoder_service.engine.engine import Engine
from encoder_service.replicas import Replicas

log = logging.getLogger(__name__)


class TakeOver:
    """`row_bytes`: one row's bytes (what a taken-over id's pin reserves per token)."""

    def __init__(self, store: EmbeddingStore, replicas: Replicas, *, flights: Flights, images: ImageReader,
                 engine: Engine, row_bytes: int):
        self.store, self.replicas = store, replicas
        self._flights, self._images, self._engine, self._row_bytes = flights, images, engine, row_bytes

    async def num_tokens(self, key: CacheKey) -> int | None:
        flight = await self._flight(key)
        return flight.num_tokens if flight is not None else None

    async def rows(self, key: CacheKey, start: int, end: int) -> torch.Tensor | None:
        flight = await self._flight(key)
        if flight is None:
            return None
        with self._flights.waiting(key.name):
            landed = await asyncio.shield(flight.task)
        return landed.entry.rows(start, end)

    async def _flight(self, key: CacheKey) -> Flight | None:
        """The flight here of an image whose accepting replica is gone: accepted here as an encode would
        (probe, queue room: Overloaded when full, a pin for the lease when room is left), from the bytes that
        replica kept in Redis. None when they are gone too."""
        flight = self._flights.get(key.name)
        if flight is not None:
            return flight
        data = await self.replicas.input(key)
        if data is None:
            return None
        caller_id = key.id[len(CALLER_PREFIX):] if key.id.startswith(CALLER_PREFIX) else None
        loop = asyncio.get_running_loop()
        image = await loop.run_in_executor(self._engine.cpu_pool, self._images.probe, 0, data, caller_id)
        if image.key.name != key.name:  # not the bytes of this id: never encode them under it
            log.warning("image bytes kept in Redis for %s hash to %s: ignored", key.name, image.key.name)
            return None
        if caller_id is not None and other_content(image.content_tag, (await self.replicas.bind_tags(
                {key: image.content_tag})).get(key.name, 0)):  # bytes of a request that lost the id: ignored
            log.warning("image bytes kept in Redis for %s are not what the id names: ignored", key.name)
            return None
        flight = self._flights.get(key.name)  # another fetch may have taken it over meanwhile
        if flight is not None:
            return flight
        (permit,) = self._engine.admit(1)
        with contextlib.suppress(errors.Overloaded):  # pins full: served all the same, from Redis after
            self.store.pin(key, nbytes=image.num_tokens * self._row_bytes)
        log.info("id %s: the replica that accepted it is gone; encoding it here", key.id)
        # One waiter for the lease, as the encode that accepted it held: a fetch that leaves does not drop it.
        return self._flights.join(image, permit, after=self.replicas.mark([image], []))
