"""The load a benchmark puts on the service, and what the service says about it.

`closed_loop`: a load generator's workers, each sending its next image once its previous one is done (encode
`wait=true`; with flow "e2e" also a fetch of all the image's rows into the worker's reused buffer and a release),
over one or more replicas: worker w encodes on replica w % R, and with `cross` every second fetch of a worker
goes to the next replica (one sharing the same Redis), so half of them cross. Raw results; the caller merges those
of its load-generator processes. `scrape`: the unlabelled samples of a service's /metrics.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Iterable


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of the service's /metrics (counters, gauges, histogram sums and counts)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


async def closed_loop(targets: list[dict], images: Iterable[bytes], workers: int, level_s: float, timeout_s: float,
                      flow: str = "e2e", transport: str = "http", cross: bool = False, verify_every: int = 0,
                      worker_offset: int = 0, count: int | None = None, out_device: str = "cpu",
                      client_kw: dict | None = None) -> dict:
    """`targets`: [{"http": url, "grpc": host:port}] per replica. Runs until the `count` images run out (None:
    `images` is an endless stream) or `level_s` has passed (requests in flight then finish, each bounded by
    `timeout_s`). `flow`: "encode" (wait=true), "e2e" (that, a fetch of all the image's rows into the worker's
    reused buffer, release), "e2e-norelease" (e2e without the release: a client that never calls it) or
    "e2e-hold" (the encode itself asks for the rows by IPC into that buffer, client encode(out=...); release). A 429
    is waited out as its Retry-After says. `verify_every` n > 0: every
    n-th crossing fetch is fetched again on the encoding replica and compared bit for bit (the same encode's
    rows through Redis and from the encoder's own tier: a difference is a wrong row). `worker_offset`: this
    process's first worker number (so that processes spread their workers' encodes over the replicas).
    `out_device`: where each worker's buffer is (a CUDA device: as an LLM server's input embeddings; with HTTP a
    fetch into it goes GPU to GPU when it can, client/ipc.py); `client_kw`: more options of the HTTP clients."""
    import httpx
    import torch

    from encoder_service.client import AsyncEncoderClient
    from encoder_service.errors import Overloaded

    limits = httpx.Limits(max_connections=workers + 4, max_keepalive_connections=workers + 4)
    clients = [AsyncEncoderClient.http(t["http"], timeout=timeout_s, limits=limits, **(client_kw or {}))
               if transport == "http" else
               AsyncEncoderClient.grpc(t["grpc"], timeout=timeout_s) for t in targets]
    rec = dict(latencies=[], encode_ms=[], fetch_ms={"same": [], "other": []}, errors=[], hits=0, wrong_rows=0,
               verified=0)
    tokens, crossed = set(), 0
    queue = iter(images)
    try:
        for client in clients:
            await client.metadata()  # connections up before the clock starts
        start, cpu0, loop_cpu0 = time.time(), time.process_time(), time.thread_time()
        deadline = time.perf_counter() + level_s

        async def worker(w: int) -> None:
            nonlocal crossed
            home = (worker_offset + w) % len(clients)
            out, n = None, 0  # the rows' destination, as an LLM server's input-embeddings buffer: reused
            while time.perf_counter() < deadline:
                data = next(queue, None)
                if data is None:
                    return
                n += 1
                other = cross and len(clients) > 1 and n % 2 == 0
                encoder, fetcher = clients[home], clients[(home + other) % len(clients)]
                t0, info = time.perf_counter(), None
                try:
                    if flow == "e2e-hold":  # the encode's answer carries the rows' hold (IPC): one request
                        def dest(i):
                            nonlocal out
                            if out is None or out.shape[0] < i.num_tokens:
                                out = torch.empty(i.num_tokens, i.row_width, dtype=getattr(torch, i.dtype),
                                                  device=out_device)
                            return out[:i.num_tokens]

                        (info,) = await encoder.encode([data], out=dest)
                    else:
                        (info,) = await encoder.encode([data], wait=True)
                    t1 = time.perf_counter()
                    if flow not in ("encode", "e2e-hold"):
                        if out is None or out.shape[0] < info.num_tokens:
                            out = torch.empty(info.num_tokens, info.row_width, dtype=getattr(torch, info.dtype),
                                              device=out_device)
                        rows = out[:info.num_tokens]
                        await fetcher.fetch([(info.id, 0)], 0, info.num_tokens, out=rows)
                        rec["fetch_ms"]["other" if other else "same"].append((time.perf_counter() - t1) * 1e3)
                        crossed += other
                        if other and verify_every and crossed % verify_every == 0:
                            own = await encoder.fetch([(info.id, 0)], 0, info.num_tokens)
                            rec["verified"] += 1
                            rec["wrong_rows"] += not torch.equal(own.rows, rows)
                        if flow == "e2e":
                            await encoder.release([info.id])
                    elif flow == "e2e-hold":
                        await encoder.release([info.id])
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    rec["errors"].append(f"{type(exc).__name__}: {exc}"[:300])
                    if info is not None and flow in ("e2e", "e2e-hold"):  # encoded, the rows failed: pin back
                        with contextlib.suppress(Exception):
                            await encoder.release([info.id])
                    if isinstance(exc, Overloaded):  # a 429: wait as its Retry-After says (a client's manners)
                        await asyncio.sleep(max(0.0, min(exc.retry_after_s, deadline - time.perf_counter())))
                    continue
                rec["latencies"].append((time.perf_counter() - t0) * 1e3)
                rec["encode_ms"].append((t1 - t0) * 1e3)
                rec["hits"] += bool(info.cached)
                tokens.add(info.num_tokens)

        await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(workers))), level_s + timeout_s + 30)
        # The loop thread's own CPU: near 1 s per second means this process's event loop was saturated.
        cpu_s, loop_cpu_s = time.process_time() - cpu0, time.thread_time() - loop_cpu0
    finally:
        for client in clients:
            await client.close()
    paths = sum((c.fetch_paths for c in clients), collections.Counter())  # how the fetches went (ipc, socket, ...)
    return rec | dict(tokens=sorted(tokens), t0=start, t1=time.time(), images=count, cpu_s=cpu_s,
                      loop_cpu_s=loop_cpu_s, fetch_paths=dict(paths))
