"""Prometheus metrics of the service, kept in one registry per core (tests run several cores per process).

`encoder_queue_depth` is the name the Helm chart's HPA scales on: keep it. Every transport observes its
requests through `Metrics.observe` (in flight, outcome, latency), so they are counted alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from encoder_service.errors import EncoderServiceError

_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


@dataclass
class Observed:
    """A request as its metrics see it: the outcome is `ok` unless the transport says otherwise."""

    outcome: str = "ok"

    def failed(self, exc: BaseException) -> None:
        """Answered with an error: its kind (anything not ours is `internal`)."""
        self.outcome = exc.kind if isinstance(exc, EncoderServiceError) else "internal"

    def cancelled(self) -> None:
        """The client left before its answer (nobody reads it, and it is not our failure)."""
        self.outcome = "cancelled"


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("encoder_requests", "Requests by method and outcome kind", ["method", "outcome"],
                                registry=r)
        self.request_ms = Histogram("encoder_request_ms", "Request latency (ms)", ["method"], buckets=_MS_BUCKETS,
                                    registry=r)
        self.queue_ms = Histogram("encoder_queue_ms", "Time an image waited for the GPU (ms)", buckets=_MS_BUCKETS,
                                  registry=r)
        self.preprocess_ms = Histogram("encoder_preprocess_ms", "Decode + resize + patchify of one image (ms)",
                                       buckets=_MS_BUCKETS, registry=r)
        self.encode_ms = Histogram("encoder_encode_ms", "One ViT batch from its launch to its rows on the host "
                                   "(ms; consecutive batches overlap)", buckets=_MS_BUCKETS, registry=r)
        self.batch_patches = Histogram("encoder_batch_patches", "Patch tokens per ViT batch",
                                       buckets=(256, 1024, 2048, 4096, 8192, 16384, 32768, 65536), registry=r)
        self.cache_ms = Histogram("encoder_cache_ms", "Cache lookup / read time (ms)", ["op"], buckets=_MS_BUCKETS,
                                  registry=r)
        self.cache_hits = Counter("encoder_cache_hits", "Cache hits per tier", ["tier"], registry=r)
        self.cache_misses = Counter("encoder_cache_misses", "Cache misses (images encoded)", registry=r)
        self.fetch_rows = Counter("encoder_fetch_rows", "Embedding rows served by fetch", registry=r)
        self.fetch_bytes = Counter("encoder_fetch_bytes", "Embedding row bytes served by fetch", registry=r)
        self.images_encoded = Counter("encoder_images_encoded", "Images run through the ViT", registry=r)
        self.batch_failures = Counter("encoder_batch_failures", "ViT batches that raised", registry=r)
        self.queue_depth = Gauge("encoder_queue_depth", "Images waiting for the GPU", registry=r)
        self.in_flight = Gauge("encoder_in_flight_requests", "Requests being served", registry=r)
        self.pending_unmarked = Counter(
            "encoder_pending_unmarked", "Ids accepted for encoding whose pending marker could not be written to "
            "Redis (down, full or busy): fetches of them on other replicas answer at once instead of waiting",
            registry=r)

    @contextlib.contextmanager
    def observe(self, method: str) -> Iterator[Observed]:
        """One request of any transport: in flight while inside; on the way out its outcome is counted (`ok`,
        what the transport set on the `Observed`, or `cancelled` when the request is cancelled inside) and
        its latency observed."""
        observed = Observed()
        t0 = time.perf_counter()
        self.in_flight.inc()
        try:
            yield observed
        except asyncio.CancelledError:  # the client left (or its deadline passed) mid-call: not our failure
            observed.outcome = "cancelled"
            raise
        finally:
            self.in_flight.dec()
            self.requests.labels(method=method, outcome=observed.outcome).inc()
            self.request_ms.labels(method=method).observe((time.perf_counter() - t0) * 1e3)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
