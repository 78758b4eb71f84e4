"""Server timings on the wire: `x-timing-<name>-ms` HTTP headers, and the same keys and values as gRPC
trailing metadata (e.g. x-timing-decode-ms, x-timing-queue-ms, x-timing-encode-ms, x-timing-total-ms)."""

from __future__ import annotations


def timing_headers(timings: dict[str, float]) -> tuple[tuple[str, str], ...]:
    """(key, value) pairs of `timings` ({"queue_ms": 1.5} -> ("x-timing-queue-ms", "1.500"))."""
    return tuple((f"x-timing-{k.removesuffix('_ms').replace('_', '-')}-ms", f"{v:.3f}") for k, v in timings.items())
