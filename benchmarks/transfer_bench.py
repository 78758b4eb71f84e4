"""Rows at wire speed (issue 20): how fast a client gets cached rows, next to curl against the same server.

The service runs in this process (core + HTTP + gRPC on 127.0.0.1, --shm-fetch) on a Qwen3-VL-8B-shaped
checkpoint whose tower is tiny but whose rows are real: 4096 x (1 + 3 deepstack levels) = 16384 bf16 values,
32 KiB a row, so a 720p JPEG's entry is 880 rows = 28.8 MB and a 1080p one 2040 rows = 66.8 MB (--small:
rows a quarter as wide, images half as tall and wide). The tower runs on the CPU: the rows come from the host
cache, the model is not what is measured. Clients run in other processes (this script with --client /
--fetcher / --encoder).

  1. one fetch at a time of each entry into a preallocated tensor, per transport and client, rounds with the
     variants interleaved: curl (one keep-alive connection, body to /dev/null, its own time_total), the HTTP
     client (raw socket; one stream, and split over `fetch_streams` connections), its async twin, gRPC
     (rows picked up over HTTP; on the stream in 1 and 4 MiB messages), httpx (the clients' path before
     issue 20), shared memory (alloc_rows); with CUDA also into a CUDA tensor (a pinned staging buffer, or a
     shared-memory staging file, then one copy).
     Median ms, GB/s, x curl, the client process's CPU ms per fetch.
  2. 16 fetches of the smaller entry at once from one client process (async clients, which read on
     threads; the blocking client from 16 threads; and, for reference, the other asyncio design: reads on the
     event loop with loop.sock_recv_into).
  3. aggregate: P client processes (and P curls) fetching the smaller entry at once; GB/s in all, and the
     server process's CPU seconds per GB sent (and the kernel's part of them).
  4. encode under fetch load: encodes of the smaller size (wait=true) one at a time, alone and while P
     processes fetch.
Every fetched tensor is compared with the encode's own rows; the script exits 1 when one differs or a client
fails.

    python -m benchmarks.transfer_bench           # the GPU machine (after `source scripts/gpu/env.sh`) or any
    python -m benchmarks.transfer_bench --small   # CI: narrower rows, few rounds (benchmarks/tests/)
    N=30 P=4,16 python -m benchmarks.transfer_bench   # rounds per variant; client processes of phases 3 and 4
    python -m benchmarks.transfer_bench --send-threads 0   # the rows written by the event loop (api/socket_send.py)
    python -m benchmarks.transfer_bench --queue-wait-s 0   # a fetch finding every send thread busy takes the loop

Prints each phase's table as soon as the phase ends, and after each rewrites
benchmarks/results/transfer_bench-<date>-<commit>.json and $OUT/transfer_bench.md (benchmarks/common/report.py):
a run cut short (a device's time limit) leaves what it measured, and names the phases not run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.children import module_command, module_env
from benchmarks.common.images import jpeg
from benchmarks.common.report import stamp, write_result
from benchmarks.common.service import in_process_service, service_settings
from benchmarks.common.stats import percentile
from tests.support.vision_checkpoints import build_wide_rows

CONFIGS = {  # rounds per variant; rounds of 16 at once and of aggregates; fetches per aggregate process and round;
    # encodes per condition; client processes of the aggregates
    "full": dict(sizes=((1280, 720), (1920, 1080)), out_hidden=4096, rounds=20, concurrent_rounds=5,
                 aggregate_fetches=20, encodes=20, processes=(4, 16)),
    "small": dict(sizes=((640, 360), (960, 540)), out_hidden=1024, rounds=3, concurrent_rounds=2,
                  aggregate_fetches=4, encodes=4, processes=(2,)),
}
MODULE = "benchmarks.transfer_bench"  # its client processes: this module with --client / --fetcher / --encoder
CONCURRENT = 16
AGGREGATE_CLIENTS = {"http": "http client", "grpc": "grpc client (rows picked up over http)",
                     "grpc-stream": "grpc client, rows on the stream"}
GOALS = dict(single_gb_s=3.0, vs_curl=0.8, concurrent_gb_s=8.0)  # issue 20, GPU host


# ---- clients (child processes) ----------------------------------------------------------------------------
def _reference(job: dict, name: str):
    import torch

    entry = job["entries"][name]
    data = Path(entry["rows_file"]).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(entry["rows"], entry["row_width"])


def _curl(url: str, body_file: str, n: int) -> list[float]:
    """n POSTs on one keep-alive connection, bodies to /dev/null: curl's own time_total of each, ms."""
    args = ["curl", "-s", "--fail", "-H", "content-type: application/json", "--data-binary", f"@{body_file}",
            "-w", "%{time_total}\\n"]
    for _ in range(n):
        args += ["-o", "/dev/null", url + "/v1/fetch"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=600).stdout
    return [float(t) * 1e3 for t in out.split()]


def _variants(job: dict, loop) -> list[tuple[str, object, bool, str]]:
    """(name, client, async?, out kind) of phase 1. Out kinds: a preallocated tensor on "cpu" or "cuda",
    "alloc" (alloc_rows: shared memory), "none" (no `out`: the rows are a tensor the client provides)."""
    import httpx
    import torch

    from encoder_service.client import AsyncEncoderClient, EncoderClient

    url, grpc, shm = job["http"], job["grpc"], dict(shm=True, shm_dir=job["shm_dir"])

    def aio(make):
        async def build():
            return make()
        return loop.run_until_complete(build())

    v = [("http", EncoderClient.http(url, fetch_streams=1), False, "cpu"),
         ("http, no out (the client's rows)", EncoderClient.http(url, fetch_streams=1), False, "none"),
         ("http, split", EncoderClient.http(url), False, "cpu"),
         ("http async", aio(lambda: AsyncEncoderClient.http(url, fetch_streams=1)), True, "cpu"),
         ("grpc (rows picked up over http)", EncoderClient.grpc(grpc, fetch_streams=1), False, "cpu"),
         ("grpc, no out (the client's rows)", EncoderClient.grpc(grpc, fetch_streams=1), False, "none"),
         ("grpc, split", EncoderClient.grpc(grpc), False, "cpu"),
         ("grpc async", aio(lambda: AsyncEncoderClient.grpc(grpc, fetch_streams=1)), True, "cpu"),
         ("grpc stream, 1 MiB messages", EncoderClient.grpc(grpc, fetch_streams=1, pickup=False), False, "cpu"),
         ("grpc stream, 4 MiB messages", EncoderClient.grpc(grpc, fetch_streams=1, pickup=False,
                                                            message_bytes=4 << 20), False, "cpu"),
         ("httpx (the client before issue 20)", EncoderClient.http(url, fetch_streams=1,
                                                                   transport=httpx.HTTPTransport()), False, "cpu"),
         ("http + shm, alloc_rows out", EncoderClient.http(url, **shm), False, "alloc"),
         ("grpc + shm, alloc_rows out", EncoderClient.grpc(grpc, **shm), False, "alloc")]
    if torch.cuda.is_available():
        v += [("http to cuda", EncoderClient.http(url, fetch_streams=1), False, "cuda"),
              ("http to cuda, split", EncoderClient.http(url), False, "cuda"),
              ("grpc to cuda, split", EncoderClient.grpc(grpc), False, "cuda"),
              ("http + shm to cuda", EncoderClient.http(url, **shm), False, "cuda")]
    return v


def _stats(ms: list[float], nbytes: int, cpu_ms: list[float] | None = None) -> dict:
    p50 = percentile(ms, 50)
    return dict(n=len(ms), p50_ms=p50, p90_ms=percentile(ms, 90), min_ms=min(ms), gb_s=nbytes / p50 / 1e6,
                client_cpu_ms=percentile(cpu_ms, 50) if cpu_ms else None)


def single(job: dict, cfg: dict, checks: list[str]) -> list[dict]:
    import torch

    from encoder_service.client.base import split_points

    loop = asyncio.new_event_loop()
    variants = _variants(job, loop)
    rows = []
    for name, entry in job["entries"].items():
        ref, nbytes, n = _reference(job, name), entry["bytes"], entry["rows"]
        curl = _curl(job["http"], entry["body_file"], cfg["rounds"] + 1)[1:]  # the first one connects
        outs, ms, cpu = {}, {v[0]: [] for v in variants}, {v[0]: [] for v in variants}
        for vname, client, is_async, kind in variants:
            outs[vname] = (client.alloc_rows(n, ref.shape[1], torch.bfloat16) if kind == "alloc" else
                           None if kind == "none" else torch.empty(n, ref.shape[1], dtype=torch.bfloat16, device=kind))
        failed = set()  # a variant that raised is reported in the checks and measured no further
        for k in range(cfg["rounds"] + 1):  # round 0 warms connections and buffers
            for vname, client, is_async, _ in variants:
                if vname in failed:
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    call = client.fetch([(entry["id"], 0)], 0, n, out=outs[vname])
                    got = loop.run_until_complete(call) if is_async else call
                    if got.rows.is_cuda:
                        torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - the other variants still run
                    checks.append(f"{name} {vname}: {type(exc).__name__}: {exc}"[:300])
                    failed.add(vname)
                    continue
                t1, c1 = time.perf_counter(), time.process_time()
                if k:
                    ms[vname].append((t1 - t0) * 1e3)
                    cpu[vname].append((c1 - c0) * 1e3)
                elif not torch.equal(got.rows.cpu(), ref):
                    checks.append(f"{name} {vname}: rows differ from the encode's")
                del got  # a caller done with the rows of one fetch before the next (no `out`: they can be reused)
        base = _stats(curl, nbytes)
        rows.append(dict(entry=name, variant="curl", streams=1, **base, vs_curl=1.0))
        for vname, client, _, kind in variants:
            if vname in failed:
                continue
            streams = 0 if "shm" in vname else len(split_points(0, n, outs[vname], client.fetch_streams))
            s = _stats(ms[vname], nbytes, cpu[vname])
            rows.append(dict(entry=name, variant=vname, streams=streams, **s, vs_curl=s["gb_s"] / base["gb_s"]))
    for _, client, is_async, _ in variants:
        loop.run_until_complete(client.close()) if is_async else client.close()
    loop.close()
    return rows


async def _concurrent_async(make, entry: dict, ref, rounds: int, checks: list[str], label: str) -> list[float]:
    import torch

    outs = [torch.empty_like(ref) for _ in range(CONCURRENT)]
    gb_s = []
    async with make() as client:
        for k in range(rounds + 1):
            t0 = time.perf_counter()
            await asyncio.gather(*(client.fetch([(entry["id"], 0)], 0, entry["rows"], out=o) for o in outs))
            if k:
                gb_s.append(CONCURRENT * entry["bytes"] / (time.perf_counter() - t0) / 1e9)
    if not all(torch.equal(o, ref) for o in outs):
        checks.append(f"{label}: rows differ from the encode's")
    return gb_s


def _concurrent_threads(client, entry: dict, ref, rounds: int, checks: list[str]) -> list[float]:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    outs = [torch.empty_like(ref) for _ in range(CONCURRENT)]
    gb_s = []
    with ThreadPoolExecutor(CONCURRENT) as pool:
        for k in range(rounds + 1):
            t0 = time.perf_counter()
            list(pool.map(lambda o: client.fetch([(entry["id"], 0)], 0, entry["rows"], out=o), outs))
            if k:
                gb_s.append(CONCURRENT * entry["bytes"] / (time.perf_counter() - t0) / 1e9)
    if not all(torch.equal(o, ref) for o in outs):
        checks.append("threads: rows differ from the encode's")
    return gb_s


def _some(got):
    """A read's bytes (or count), never nothing: the server closing mid-answer ends the read loop."""
    if not got:
        raise ConnectionError("the server closed the connection mid-answer")
    return got


class LoopReader:
    """The other asyncio design, kept as a reference: one fetch per keep-alive socket read on the event loop
    itself (loop.sock_recv_into, no threads) into a RowWriter. Not the client's path: measured against it."""

    def __init__(self, url: str):
        from urllib.parse import urlsplit

        self._address = (urlsplit(url).hostname, urlsplit(url).port)
        self._idle = []

    async def fetch(self, body: bytes, out):
        import socket

        from encoder_service.protocol import wire

        loop = asyncio.get_running_loop()
        if self._idle:
            sock = self._idle.pop()
        else:
            sock = socket.create_connection(self._address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        await loop.sock_sendall(sock, b"POST /v1/fetch HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                      b"content-length: %d\r\n\r\n" % len(body) + body)
        buf = bytearray()
        while b"\r\n\r\n" not in buf:  # the head and whatever came with it (small reads: bounded by the head)
            buf += _some(await loop.sock_recv(sock, 65536))
        head, rest = bytes(buf).split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < 4 or len(rest) < 4 + int.from_bytes(rest[:4], "little"):
            rest += _some(await loop.sock_recv(sock, 65536))
        pos = 0

        def read(n):
            nonlocal pos
            pos += n
            return rest[pos - n:pos]

        writer = wire.RowWriter(wire.read_http_header(read, length), out)
        writer.write(rest[pos:])
        while writer.remaining:
            writer.advance(_some(await loop.sock_recv_into(sock, writer.next_view())))
        self._idle.append(sock)
        return writer.finish()


async def _loop_reader(job: dict, entry: dict, ref, rounds: int, checks: list[str]) -> list[float]:
    import torch

    reader, body = LoopReader(job["http"]), Path(entry["body_file"]).read_bytes()
    outs = [torch.empty_like(ref) for _ in range(CONCURRENT)]
    gb_s = []
    for k in range(rounds + 1):
        t0 = time.perf_counter()
        await asyncio.gather(*(reader.fetch(body, o) for o in outs))
        if k:
            gb_s.append(CONCURRENT * entry["bytes"] / (time.perf_counter() - t0) / 1e9)
    if not all(torch.equal(o, ref) for o in outs):
        checks.append("loop reader: rows differ from the encode's")
    for sock in reader._idle:
        sock.close()
    return gb_s


def concurrent(job: dict, cfg: dict, checks: list[str]) -> list[dict]:
    from encoder_service.client import AsyncEncoderClient, EncoderClient

    url, grpc, rounds = job["http"], job["grpc"], cfg["concurrent_rounds"]
    entry = job["entries"][job["first"]]
    ref = _reference(job, job["first"])
    clients = {
        "http async": lambda: AsyncEncoderClient.http(url, fetch_streams=1),
        "grpc async (rows picked up over http)": lambda: AsyncEncoderClient.grpc(grpc, fetch_streams=1),
        "grpc async, stream": lambda: AsyncEncoderClient.grpc(grpc, fetch_streams=1, pickup=False),
    }
    runs = {label: (lambda label=label, make=make: asyncio.run(_concurrent_async(make, entry, ref, rounds, checks,
                                                                               label)))
            for label, make in clients.items()}
    rows = []

    def threads():
        with EncoderClient.http(url, fetch_streams=1) as client:
            return _concurrent_threads(client, entry, ref, rounds, checks)

    runs[f"http, {CONCURRENT} threads"] = threads
    runs["reference: asyncio loop.sock_recv_into, no threads"] = \
        lambda: asyncio.run(_loop_reader(job, entry, ref, rounds, checks))
    for label, run in runs.items():
        try:
            gb_s = run()
        except Exception as exc:  # noqa: BLE001 - the other variants still run
            checks.append(f"{CONCURRENT} at once, {label}: {type(exc).__name__}: {exc}"[:300])
            continue
        rows.append(dict(variant=label, gb_s=percentile(gb_s, 50), best_gb_s=max(gb_s)))
    return rows


CLIENT_PHASES = {"single": single, "concurrent": concurrent}  # run in a client process of their own


def client_main(job_path: str, phase: str) -> int:
    """Phase 1 or 2 in this process; writes {"rows", "checks"} to the job's result file of that phase."""
    job = json.loads(Path(job_path).read_text())
    checks: list[str] = []
    rows = CLIENT_PHASES[phase](job, job["cfg"], checks)
    Path(job["result"].format(phase=phase)).write_text(json.dumps(dict(rows=rows, checks=checks)))
    return 0


def fetcher_main(job_path: str, kind: str, count: int) -> int:
    """A fetching process, driven by lines on stdin: "go" fetches the smaller entry `count` times, "run" fetches
    until the next line; after each it prints {"bytes", "t0", "t1"} (wall clock) and whether the rows were
    right. Ends at EOF."""
    import queue
    import threading

    import torch

    from encoder_service.client import EncoderClient

    job = json.loads(Path(job_path).read_text())
    entry, ref = job["entries"][job["first"]], _reference(job, job["first"])
    client = EncoderClient.http(job["http"], fetch_streams=1) if kind == "http" else \
        EncoderClient.grpc(job["grpc"], fetch_streams=1, pickup=kind == "grpc")
    out = torch.empty_like(ref)
    client.fetch([(entry["id"], 0)], 0, entry["rows"], out=out)  # connected, buffers touched
    lines: queue.Queue[str] = queue.Queue()

    def read_stdin():
        for line in iter(sys.stdin.readline, ""):
            lines.put(line.strip())
        lines.put("")  # EOF

    threading.Thread(target=read_stdin, daemon=True).start()
    print("ready", flush=True)
    while command := lines.get():
        t0, done = time.time(), 0
        while (done < count) if command == "go" else lines.empty():
            client.fetch([(entry["id"], 0)], 0, entry["rows"], out=out)
            done += 1
        if command == "run":
            lines.get()  # the line that stopped it
        print(json.dumps(dict(bytes=done * entry["bytes"], t0=t0, t1=time.time(), ok=torch.equal(out, ref))),
              flush=True)
    client.close()
    return 0


def encoder_main(job_path: str, count: int, base: int) -> int:
    """`count` distinct encodes of the smaller size (wait=true), one at a time; prints their latencies (ms)."""
    from encoder_service.client import EncoderClient

    job = json.loads(Path(job_path).read_text())
    images = [jpeg(*job["cfg"]["sizes"][0], base + k) for k in range(count + 1)]
    with EncoderClient.http(job["http"], timeout=120) as client:
        ms = []
        for k, data in enumerate(images):
            t0 = time.perf_counter()
            (info,) = client.encode([data], wait=True)
            if k:
                ms.append((time.perf_counter() - t0) * 1e3)
            client.release([info.id])
    print(json.dumps(ms), flush=True)
    return 0


# ---- phases 3 and 4, driven from here ---------------------------------------------------------------------
def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(module_command(MODULE, *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=module_env())


def _fetchers(job_path: Path, kind: str, n: int, count: int) -> list[subprocess.Popen]:
    procs = [_start(["--fetcher", str(job_path), kind, str(count)]) for _ in range(n)]
    for proc in procs:
        proc.stdout.readline()  # ready: imported, connected, warmed
    return procs


def _tell(procs: list[subprocess.Popen], line: str) -> None:
    for proc in procs:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()


def _reports(procs: list[subprocess.Popen]) -> list[dict]:
    return [json.loads(proc.stdout.readline()) for proc in procs]


def _close(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=60)


def _server_cpu() -> tuple[float, float]:
    """This process's (user, system) CPU seconds: the server's (the main thread only waits). System time is
    the kernel's send path (every byte copied into socket buffers), which how Python hands over the bytes
    hardly changes."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _per_gb(cpu0: tuple[float, float], nbytes: int) -> tuple[float, float]:
    """(CPU seconds in all, system seconds) per GB of `nbytes` sent since `cpu0`."""
    (u0, k0), (u1, k1) = cpu0, _server_cpu()
    return (u1 - u0 + k1 - k0) / (nbytes / 1e9), (k1 - k0) / (nbytes / 1e9)


def aggregate(job_path: Path, job: dict, cfg: dict, checks: list[str], p: int) -> list[dict]:
    """P processes fetching at once, next to P curls, in interleaved rounds (median); with the server
    process's CPU time per GB sent, in all and the kernel's part."""
    entry, rows = job["entries"][job["first"]], []
    count = cfg["aggregate_fetches"]
    curl_args = ["curl", "-s", "--fail", "-H", "content-type: application/json", "--data-binary",
                 f"@{entry['body_file']}", *(["-o", "/dev/null", job["http"] + "/v1/fetch"] * count)]
    fetchers = {kind: _fetchers(job_path, kind, p, count) for kind in AGGREGATE_CLIENTS}
    try:
        runs = {AGGREGATE_CLIENTS[kind]: [] for kind in fetchers} | {"curl": []}
        for _ in range(cfg["concurrent_rounds"]):
            for kind, procs in fetchers.items():
                cpu0 = _server_cpu()
                _tell(procs, "go")
                reports = _reports(procs)
                total = sum(r["bytes"] for r in reports)
                wall = max(r["t1"] for r in reports) - min(r["t0"] for r in reports)
                runs[AGGREGATE_CLIENTS[kind]].append((total / wall / 1e9, *_per_gb(cpu0, total)))
                if not all(r["ok"] for r in reports):
                    checks.append(f"aggregate {kind} x{p}: rows differ from the encode's")
            t0, cpu0 = time.time(), _server_cpu()
            curls = [subprocess.Popen(curl_args) for _ in range(p)]
            if any(c.wait(timeout=600) for c in curls):
                checks.append(f"aggregate curl x{p}: a curl failed")
            total = p * count * entry["bytes"]
            runs["curl"].append((total / (time.time() - t0) / 1e9, *_per_gb(cpu0, total)))
    finally:
        for procs in fetchers.values():
            _close(procs)
    for variant, got in runs.items():
        gb_s, cpu, system = zip(*got)
        rows.append(dict(variant=variant, processes=p, gb_s=percentile(gb_s, 50), best_gb_s=max(gb_s),
                         server_cpu_s_per_gb=percentile(cpu, 50), server_sys_s_per_gb=percentile(system, 50)))
    return rows


def encode_under_load(job_path: Path, job: dict, cfg: dict, checks: list[str]) -> list[dict]:
    """Encode latency alone, then while max(P) HTTP clients fetch without pause."""
    rows, p = [], max(cfg["processes"])
    fetchers = _fetchers(job_path, "http", p, 0)
    try:
        for k, loaded in enumerate((False, True)):
            if loaded:
                _tell(fetchers, "run")
            enc = _start(["--encoder", str(job_path), str(cfg["encodes"]), str(10_000 * (k + 1))])
            ms = json.loads(enc.communicate(timeout=900)[0])
            gb = 0.0
            if loaded:
                _tell(fetchers, "stop")
                reports = _reports(fetchers)
                gb = sum(r["bytes"] for r in reports) / 1e9
                if not all(r["ok"] for r in reports):
                    checks.append("encode under load: fetched rows differ from the encode's")
            rows.append(dict(fetch_load=f"{p} processes fetching" if loaded else "none", encodes=len(ms),
                             p50_ms=percentile(ms, 50), p90_ms=percentile(ms, 90), fetched_gb=gb))
    finally:
        _close(fetchers)
    return rows


# ---- report -----------------------------------------------------------------------------------------------
def _single_table(rows: list[dict], first: str) -> list[str]:
    lines = ["## One fetch at a time into a preallocated tensor, or with no `out` where the client says so (median of "
             "the rounds; x curl: GB/s over curl's)",
             "", "| entry | client | streams | median ms | p90 ms | best ms | GB/s | x curl | client CPU ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = "" if r.get("client_cpu_ms") is None else f"{r['client_cpu_ms']:.1f}"
        lines.append(f"| {r['entry']} | {r['variant']} | {r['streams'] or 'shm'} | {r['p50_ms']:.1f} "
                     f"| {r['p90_ms']:.1f} | {r['min_ms']:.1f} | {r['gb_s']:.2f} | {r['vs_curl']:.2f} | {cpu} |")
    return lines


def _concurrent_table(rows: list[dict], first: str) -> list[str]:
    return [f"## {CONCURRENT} fetches of the {first} entry at once from one client process", "",
            "| client | GB/s in all (median) | best |", "|---|---|---|",
            *(f"| {r['variant']} | {r['gb_s']:.2f} | {r['best_gb_s']:.2f} |" for r in rows)]


def _aggregate_table(rows: list[dict], first: str) -> list[str]:
    return [f"## Aggregate: client processes fetching the {first} entry at once", "",
            "| client | processes | GB/s in all (median) | best | server CPU s per GB | of which system (kernel) |",
            "|---|---|---|---|---|---|",
            *(f"| {r['variant']} | {r['processes']} | {r['gb_s']:.2f} | {r['best_gb_s']:.2f} "
              f"| {r['server_cpu_s_per_gb']:.3f} | {r['server_sys_s_per_gb']:.3f} |" for r in rows)]


def _encode_table(rows: list[dict], first: str) -> list[str]:
    return [f"## Encode latency ({first} JPEGs, wait=true, one at a time) alone and under fetch load", "",
            "| fetch load | encodes | p50 ms | p90 ms | GB fetched meanwhile |", "|---|---|---|---|---|",
            *(f"| {r['fetch_load']} | {r['encodes']} | {r['p50_ms']:.1f} | {r['p90_ms']:.1f} | {r['fetched_gb']:.1f} |"
              for r in rows)]


TABLES = {"single": _single_table, "concurrent": _concurrent_table, "aggregate": _aggregate_table,
          "encode": _encode_table}


class Report:
    """The run's results as its phases end: each phase's table printed at once (flushed), the JSON and the
    markdown rewritten (benchmarks/common/report.py), so a run cut short by a timeout still leaves what it
    measured; `pending` names the phases still to come."""

    def __init__(self, setup: dict, first: str, pending: list[str], t_start: float):
        self.setup, self.first, self.pending, self._start = setup, first, pending, t_start
        self.result: dict[str, list[dict]] = {}
        self.checks: list[str] = []

    def phase(self, label: str, table: str, run) -> None:
        """`run(checks) -> rows` as phase `label`, its rows added to `table`; a phase that raises is a check
        and the next one still runs."""
        seen = len(self.checks)
        try:
            rows = run(self.checks)
        except Exception as exc:  # noqa: BLE001 - keep what was measured, report the failure
            self.checks.append(f"phase {label}: {type(exc).__name__}: {exc}"[:300])
            rows = []
        self.result.setdefault(table, []).extend(rows)
        self.pending.remove(label)
        print("\n".join(["", *TABLES[table](rows, self.first)]), flush=True)
        if len(self.checks) > seen:
            print("Checks failed in this phase: " + "; ".join(self.checks[seen:]), flush=True)
        self.save()

    def head(self) -> list[str]:
        return ["# Rows at wire speed: fetch of cached entries, client next to curl (service in process, 127.0.0.1)",
                "", ", ".join(f"{k}: {v}" for k, v in self.setup.items())]

    def markdown(self) -> str:
        lines = [*self.head(), ""]
        for table, rows in self.result.items():
            lines += [*TABLES[table](rows, self.first), ""]
        if self.pending:
            lines += ["Not run (yet): " + ", ".join(self.pending), ""]
        lines.append("Checks: " + ("all passed" if not self.checks else "; ".join(self.checks)))
        return "\n".join(lines) + "\n"

    def save(self) -> None:
        self.setup["total_s"] = round(time.perf_counter() - self._start, 1)
        write_result("transfer_bench", self.setup, dict(self.result, goals=GOALS, failed_checks=self.checks,
                                                         not_run=self.pending), self.markdown())


def _client_phase(job_path: Path, job: dict, phase: str, checks: list[str]) -> list[dict]:
    """Phase 1 or 2 in a client process of its own (the clients' CPU time is theirs alone)."""
    proc = subprocess.run(module_command(MODULE, "--client", str(job_path), phase), env=module_env(), timeout=1200,
                          check=False)
    if proc.returncode:
        raise RuntimeError(f"the client process failed (exit {proc.returncode})")
    got = json.loads(Path(job["result"].format(phase=phase)).read_text())
    checks += got["checks"]
    return got["rows"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="narrower rows, few rounds (CI)")
    parser.add_argument("--send-threads", type=int, default=None,
                        help="the service's --send-threads (default: its default; 0: the event loop sends)")
    parser.add_argument("--queue-wait-s", type=float, default=None,
                        help="how long a fetch waits for a busy send thread before the loop sends it "
                             "(api/socket_send.py: QUEUE_WAIT_S; default: that)")
    parser.add_argument("--client", nargs=2, metavar=("JOB_JSON", "PHASE"), help=argparse.SUPPRESS)
    parser.add_argument("--fetcher", nargs=3, metavar=("JOB_JSON", "KIND", "COUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--encoder", nargs=3, metavar=("JOB_JSON", "COUNT", "BASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(*args.client)
    if args.fetcher:
        return fetcher_main(args.fetcher[0], args.fetcher[1], int(args.fetcher[2]))
    if args.encoder:
        return encoder_main(args.encoder[0], int(args.encoder[1]), int(args.encoder[2]))
    if shutil.which("curl") is None:
        parser.error("needs curl on PATH (the reference every client is measured against)")

    import torch

    from encoder_service.api import socket_send
    from encoder_service.api.service import bind_socket
    from encoder_service.client import EncoderClient
    from encoder_service.protocol import wire

    if args.queue_wait_s is not None:  # the service runs in this process
        socket_send.QUEUE_WAIT_S = args.queue_wait_s
    cfg = dict(CONFIGS["small" if args.small else "full"])
    cfg["rounds"] = int(os.environ.get("N", cfg["rounds"]))
    if os.environ.get("P"):
        cfg["processes"] = tuple(int(p) for p in os.environ["P"].split(","))
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = tmp / "checkpoint"
        checkpoint.mkdir()
        build_wide_rows(checkpoint, cfg["out_hidden"])
        sock = bind_socket("127.0.0.1", 0)
        settings = service_settings(checkpoint, torch.device("cpu"), torch.bfloat16, sock, "--cache-bytes", "4GiB",
                                    "--max-pixels", "20000000", "--shm-fetch",
                                    *(["--send-threads", str(args.send_threads)] if args.send_threads is not None
                                      else []))
        svc = in_process_service(settings, sock)
        try:
            entries = {}
            with EncoderClient.grpc(svc.grpc_address, timeout=600) as client:
                for size in cfg["sizes"]:
                    name = f"{size[0]}x{size[1]}"
                    (info,) = client.encode([jpeg(*size, seed=7)], wait=True, return_embeddings=True)
                    rows_file, body_file = tmp / f"{name}.rows", tmp / f"{name}.json"
                    rows_file.write_bytes(bytes(wire.row_bytes(info.embedding)))
                    body_file.write_text(json.dumps({"items": [{"id": info.id, "offset": 0}], "start": 0,
                                                     "end": info.num_tokens}))
                    entries[name] = dict(id=info.id, rows=info.num_tokens, row_width=info.row_width,
                                         bytes=info.embedding.numel() * 2, rows_file=str(rows_file),
                                         body_file=str(body_file))
            job_path = tmp / "job.json"
            job = dict(http=svc.url, grpc=svc.grpc_address, shm_dir=settings.server.shm_dir, cfg=cfg,
                       entries=entries, first=next(iter(entries)), result=str(tmp / "client-{phase}.json"))
            job_path.write_text(json.dumps(job))
            setup = stamp() | dict(
                machine=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu only",
                cpu_count=os.cpu_count(), python=sys.version.split()[0], torch=torch.__version__,
                sizes="small" if args.small else "real",
                entries={k: f"{v['rows']} x {v['row_width']} bf16 = {v['bytes'] / 1e6:.1f} MB"
                         for k, v in entries.items()},
                rounds=cfg["rounds"], processes=list(cfg["processes"]),
                rows_sent_by=svc.service.rows_written_by, queue_wait_s=socket_send.QUEUE_WAIT_S,
                setup_s=round(time.perf_counter() - t_start, 1))
            aggregates = {f"aggregate x{p}": p for p in cfg["processes"]}
            report = Report(setup, job["first"], ["single", "concurrent", *aggregates, "encode"], t_start)
            print("\n".join(report.head()), flush=True)
            for phase in CLIENT_PHASES:
                report.phase(phase, phase, lambda checks, phase=phase: _client_phase(job_path, job, phase, checks))
            for label, p in aggregates.items():
                report.phase(label, "aggregate", lambda checks, p=p: aggregate(job_path, job, cfg, checks, p))
            report.phase("encode", "encode", lambda checks: encode_under_load(job_path, job, cfg, checks))
        finally:
            svc.close()
    report.save()
    print("\nChecks: " + ("all passed" if not report.checks else "; ".join(report.checks)), flush=True)
    return 1 if report.checks else 0


if __name__ == "__main__":
    sys.exit(main())
