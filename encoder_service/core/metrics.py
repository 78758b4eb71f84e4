"""Prometheus metrics of the service, kept in one registry per core (tests run several cores per process).

`encoder_queue_depth` is the name the Helm chart's HPA scales on: keep it. Every transport (http, grpc,
sglang) observes its requests through `Metrics.observe` (in flight, outcome, latency), so they are counted
alike and told apart by the `transport` label. Latencies are in seconds (`*_seconds`, Prometheus's
convention); their `*_ms` twins are deprecated and go in the next release (their help says so).
`encoder_build_info` (always 1) carries what this process runs as labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from encoder_service import __version__
from encoder_service.errors import EncoderServiceError

_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)
_SECONDS_BUCKETS = tuple(ms / 1000 for ms in _MS_BUCKETS)  # the same bounds
BUILD_LABELS = ("version", "commit", "torch", "transformers", "attention", "preprocess")


@dataclass
class Observed:
    """A request as its metrics see it: the outcome is `ok` unless the transport says otherwise; `seconds`
    is its latency, once it is over."""

    outcome: str = "ok"
    seconds: float | None = None

    def failed(self, exc: BaseException) -> None:
        """Answered with an error: its kind (anything not ours is `internal`)."""
        self.outcome = exc.kind if isinstance(exc, EncoderServiceError) else "internal"

    def cancelled(self) -> None:
        """The client left before its answer (nobody reads it, and it is not our failure)."""
        self.outcome = "cancelled"


class Latency:
    """A latency histogram `<name>_seconds`, and for one release its deprecated twin `<name>_ms`."""

    def __init__(self, name: str, help: str, registry: CollectorRegistry, labels: tuple[str, ...] = ()):
        self._seconds = Histogram(f"{name}_seconds", f"{help} (seconds)", labels, buckets=_SECONDS_BUCKETS,
                                  registry=registry)
        self._ms = Histogram(f"{name}_ms", f"Deprecated, removed in the next release: use {name}_seconds. {help} "
                             "(ms)", labels, buckets=_MS_BUCKETS, registry=registry)
        self._children: dict[tuple, tuple] = {}  # label values -> both histograms' children (a few per process)

    def observe(self, seconds: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        children = self._children.get(key)
        if children is None:  # prometheus_client's labels() lookup is a measurable share of a small request
            children = self._children[key] = tuple(h.labels(**labels) if labels else h
                                                   for h in (self._seconds, self._ms))
        children[0].observe(seconds)
        children[1].observe(seconds * 1e3)


def build_labels(*, attention: str, preprocess: str, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`encoder_build_info`'s labels. The commit: ENCODER_GIT_COMMIT (set when the image is built), else the
    checkout this package runs from (`git rev-parse HEAD`), else "unknown"."""
    import torch

    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = "none"
    return {"version": __version__, "commit": env.get("ENCODER_GIT_COMMIT") or _checkout_commit(),
            "torch": torch.__version__, "transformers": transformers, "attention": attention, "preprocess": preprocess}


def _checkout_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():  # an installed wheel: no checkout of ours around it
        return "unknown"
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("encoder_requests", "Requests by transport, method and outcome kind",
                                ["transport", "method", "outcome"], registry=r)
        self._request_counts: dict[tuple[str, str, str], object] = {}  # (transport, method, outcome) -> child
        self.request_latency = Latency("encoder_request", "Request latency", r, ("transport", "method"))
        self.queue_latency = Latency("encoder_queue", "Time an image waited for the GPU", r)
        self.preprocess_latency = Latency("encoder_preprocess", "Decode + resize + patchify of one image", r)
        self.encode_latency = Latency("encoder_encode", "One ViT batch from its launch to its rows on the host "
                                      "(consecutive batches overlap)", r)
        self.batch_patches = Histogram("encoder_batch_patches", "Patch tokens per ViT batch",
                                       buckets=(256, 1024, 2048, 4096, 8192, 16384, 32768, 65536), registry=r)
        self.cache_latency = Latency("encoder_cache", "Cache lookup / read time", r, ("op",))
        self.cache_hits = Counter("encoder_cache_hits", "Cache hits per tier", ["tier"], registry=r)
        self.cache_misses = Counter("encoder_cache_misses", "Cache misses (images encoded)", registry=r)
        self.fetch_rows = Counter("encoder_fetch_rows", "Embedding rows served by fetch", registry=r)
        self.fetch_bytes = Counter("encoder_fetch_bytes", "Embedding row bytes served by fetch", registry=r)
        self.images_encoded = Counter("encoder_images_encoded", "Images run through the ViT for requests "
                                      "(the start-up warm-up is not one)", registry=r)
        self.batch_failures = Counter("encoder_batch_failures", "ViT batches that raised", registry=r)
        self.queue_depth = Gauge("encoder_queue_depth", "Images waiting for the GPU", registry=r)
        self.in_flight = Gauge("encoder_in_flight_requests", "Requests being served", registry=r)
        self.pending_unmarked = Counter(
            "encoder_pending_unmarked", "Ids accepted for encoding whose pending marker could not be written to "
            "Redis (down, full or busy): fetches of them on other replicas answer at once instead of waiting",
            registry=r)
        self.graph_capture_failures = Counter(
            "encoder_graph_capture_failures", "CUDA-graph captures that failed at startup, by bucket (patch rows) "
            "and graph kind: a graph is tried twice, then its batches run eagerly", ["bucket", "kind"], registry=r)
        self.graphs_eager = Gauge("encoder_graphs_eager", "Graphs whose capture failed twice at startup: the "
                                  "batches that would replay them run eagerly", registry=r)
        self._build_info = Gauge("encoder_build_info", "What this process runs (always 1): the package version, "
                                 "its git commit, torch and transformers versions, the --attention and "
                                 "--preprocess in use", BUILD_LABELS, registry=r)

    def build_info(self, **labels: str) -> None:
        """Set `encoder_build_info` (one sample, 1) with these labels (BUILD_LABELS)."""
        self._build_info.clear()
        self._build_info.labels(**labels).set(1)

    def graph_captures(self, runner: dict) -> None:
        """The runner's failed captures (its describe(): `capture_failures`, none for an eager runner)."""
        failures = runner.get("capture_failures", [])
        for f in failures:
            self.graph_capture_failures.labels(str(f["bucket"]), f["kind"]).inc(len(f["errors"]))
        self.graphs_eager.set(sum(f["eager"] for f in failures))

    @contextlib.contextmanager
    def observe(self, transport: str, method: str) -> Iterator[Observed]:
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
            observed.seconds = time.perf_counter() - t0
            self.in_flight.dec()
            key = (transport, method, observed.outcome)
            counter = self._request_counts.get(key)
            if counter is None:
                counter = self._request_counts[key] = self.requests.labels(*key)
            counter.inc()
            self.request_latency.observe(observed.seconds, transport=transport, method=method)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
