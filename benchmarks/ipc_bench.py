"""Rows GPU to GPU on one host (issue 34): the fetch by IPC next to the other paths and the raw device copy, the
vLLM connector's cached image onto "vLLM's" GPU, and the service end to end at concurrency 64 against the model
alone.

The Qwen3-VL-8B vision tower at its real size (random weights, bf16, CUDA graphs: the service's own build_core,
device row arena at its default size, --shm-fetch) serves in this process on cuda:0; the consumers are other
processes (this module with --consumer, started with subprocess, one per consumer device: cuda:0, and cuda:1
when two GPUs are visible), as an LLM server is:

  1. model alone (this process, before the service starts): the runner on preprocessed 720p images per batch
     size (benchmarks/common/model_alone.py; its best batch's images/s is the reference of part 4), and what
     the arena costs: the batch's device-to-device copy into it per image, beside the device-to-host copy the
     engine makes anyway (what a lazy host copy would save), and the runner's images/s with that copy added.
  2. paths, per consumer device, for a cached 720p (28.8 MB) and 1080p (66.8 MB) entry: fetch of all rows into
     a device `out`, synchronized, ms: ipc (our client's fetch by IPC; its first fetch, which opens the
     arena's handle, apart), shm (the encoder writes into a registered `alloc_rows` buffer, then one copy to
     the device: the best path before IPC), socket (HTTP into the device `out`), and the raw device copy
     (a tensor on the encoder's GPU copied into `out` in the consumer's process, no service).
  3. the vLLM connector, warm (the 1080p entry cached at the encoder, not at the connector), as
     benchmarks/connector_bench.py drives it: scheduler side staged (ensure polled; by ipc: its fetch holds
     the rows in the encoder's arena) -> the worker's load on its device (synchronized; by ipc: its copy
     under that hold, no request), by ipc and by shm.
  4. end to end: one client process on the last consumer device, concurrency 64, distinct 720p JPEGs (each
     request's bytes its own), encode wait=true, fetch of all rows into a CUDA `out`, release; images/s by
     ipc, by ipc-hold (one request: the encode's answer carries the hold, client encode(out=...)) and by
     socket, as % of part 1's reference.
  5. the same-host channel against HTTP (issue 40), per consumer device, --runs runs (default 5) of each in
     turn: the cached 1080p entry into the device `out` by IPC (our client, the request over the server's Unix
     socket, or over HTTP: ipc_channel=False), and the vLLM connector's load of it (ipc_channel auto / off),
     p50 ms per run against issue 40's goals (0.3 / 0.6 ms in every run).
Parts 2 and 3 go over the channel (the clients' default) when the server has one.
Every fetched tensor is checked bit for bit against the socket fetch (exit 1 otherwise); a path that is
refused (CUDA IPC not allowed here) falls back and the table says which path served. Parts that would run
past --budget-s are skipped (named in the report).

    python -m benchmarks.ipc_bench                 # GPU host (H200: about 4 minutes, --budget-s 235)
    python -m benchmarks.ipc_bench --runs 5        # part 5's runs (default 5; --small 2)
    python -m benchmarks.ipc_bench --small         # CPU smoke: tiny Qwen3-VL, the arena's host stand-in
    N=50 python -m benchmarks.ipc_bench            # iterations per path (default 30; --small 3)

Writes benchmarks/results/ipc_bench-<date>-<commit>.json and $OUT/ipc_bench.md (benchmarks/common/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import children
from benchmarks.common.device import bench_device, sync
from benchmarks.common.images import jpeg, stamped
from benchmarks.common.load import closed_loop
from benchmarks.common.model_alone import BATCHES, SMALL_BATCHES, engine_inputs, model_alone, reference_text
from benchmarks.common.models import NAMES, build_checkpoint
from benchmarks.common.report import ROOT, setup_info, write_result
from benchmarks.common.service import in_process_service, service_settings
from benchmarks.common.stats import percentile
from encoder_service.protocol.ipc import IpcPlacement, IpcRequest, this_host

FAMILY = "qwen3_vl"
SIZES = {"720p": (1280, 720), "1080p": (1920, 1080)}
GOALS = dict(fetch_ms=0.5, connector_ms=1.0, e2e_fraction=0.95)  # issue 34's goals
CHANNEL_GOALS = dict(fetch_ms=0.3, connector_ms=0.6)  # issue 40's: p50 in every one of the runs
# Rough seconds per part on an H200 (the budget skips what would not fit).
ESTIMATE_S = dict(model=20, paths=25, connector=10, channel=30, e2e=25)
POLL_S = 0.0002  # how often the connector's scheduler side asks ensure() (vLLM: once per engine step)


def _stats(ms: list[float]) -> dict:
    return dict(p50_ms=percentile(ms, 50), p90_ms=percentile(ms, 90), min_ms=min(ms) if ms else float("nan"),
                n=len(ms))


def _timed(fn, n: int, sync_fn) -> list[float]:
    for _ in range(2):  # warm-up: connections, buffers, first copies
        fn()
        sync_fn()
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync_fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


# ---- the consumer (child process) ---------------------------------------------------------------------------
class Consumer:
    """Another process on this host with its own device, as an LLM server is."""

    def __init__(self, job: dict):
        from encoder_service.testing.host_ipc import HostStandInReader

        self.job, self.n = job, job["n"]
        self.device, self.source = torch.device(job["device"]), torch.device(job["source"])
        self.reader = HostStandInReader(job["standin_dir"]) if job.get("standin_dir") else "auto"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def sync(self) -> None:
        for d in {self.device, self.source}:  # a copy across GPUs is ordered on both
            sync(d)

    def client(self, **kw):
        from encoder_service.client import EncoderClient

        return EncoderClient.http(self.job["url"], timeout=120, **kw)

    def paths(self) -> dict:
        from encoder_service.client.http import HttpTransport
        from encoder_service.client.ipc import CudaIpcReader

        rows, checks, notes = [], [], []
        reader = CudaIpcReader() if self.reader == "auto" else self.reader
        with contextlib.closing(HttpTransport(self.job["url"])) as probes, self.client(ipc="off") as plain, \
                self.client(ipc=self.reader) as ipc, \
                self.client(ipc="off", shm=True, shm_dir=self.job["shm_dir"]) as shm:
            for k, (name, size) in enumerate(SIZES.items()):
                (info,) = plain.encode([jpeg(*size, seed=7000 + k)], wait=True)
                item, n = [(info.id, 0)], info.num_tokens
                ref = plain.fetch(item, 0, n).rows
                out = torch.empty_like(ref, device=self.device)
                on_source, buf = ref.to(self.source), shm.alloc_rows(n, ref.shape[1], ref.dtype)
                registered = self._register(buf, notes)
                t0 = time.perf_counter()
                ipc.fetch(item, 0, n, out=out)
                self.sync()
                first_ms = (time.perf_counter() - t0) * 1e3
                probe = IpcRequest(this_host(), hold=False).to_dict()
                held_acks: list[str] = []

                def held_copy():  # what the client does, without it: a held request, the copy, the sync
                    request = IpcRequest(this_host(), hold=True, ack=tuple(held_acks)).to_dict()
                    held_acks.clear()
                    _, answer = probes.fetch_ipc(item, 0, n, request, 120)
                    if not isinstance(answer, IpcPlacement):
                        raise RuntimeError(f"not placed: {answer}")
                    reader.copy(answer.handle, answer.generation, [(answer.offsets[0], out.nbytes, out)])
                    reader.synchronize(out.device)
                    held_acks.append(answer.token)

                variants = [
                    ("ipc", "fetch by IPC into the device `out` (GPU to GPU)", lambda: ipc.fetch(item, 0, n, out=out)),
                    ("ipc request", "its request alone (over the channel when there is one): a probe (nothing "
                     "held, nothing copied)",
                     lambda: probes.fetch_ipc(item, 0, n, probe, 120)),
                    ("ipc, no client", "a held request, the copy and the sync as the client makes them, without it",
                     held_copy),
                    ("shm", "shared memory into a registered alloc_rows buffer, then one copy to the device",
                     lambda: (shm.fetch(item, 0, n, out=buf), out.copy_(buf, non_blocking=registered))),
                    ("socket", "HTTP socket into the device `out`", lambda: plain.fetch(item, 0, n, out=out)),
                    ("device copy", f"raw copy {self.source} -> {self.device}, no service",
                     lambda: out.copy_(on_source))]
                for key, what, fn in variants:
                    out.fill_(float("nan"))
                    paths_before = dict(ipc.fetch_paths)
                    ms = _timed(fn, self.n, self.sync)
                    if key == "ipc request":
                        rows.append(dict(image=name, key=key, path=what, served="probe", consumer=str(self.device),
                                         mbytes=ref.nbytes / 1e6, first_ms=None, **_stats(ms)))
                        continue
                    if not torch.equal(out.cpu(), ref):
                        checks.append(f"{name} {key}: rows on {self.device} differ from the socket fetch's")
                    served = key
                    if key == "ipc":
                        took = {p: c - paths_before.get(p, 0) for p, c in ipc.fetch_paths.items()}
                        served = "ipc" if took.get("ipc", 0) == len(ms) + 2 else f"fell back ({took})"
                        if ipc.ipc_off:
                            notes.append(f"IPC refused in the consumer on {self.device}: {ipc.ipc_off}")
                    rows.append(dict(image=name, key=key, path=what, served=served, consumer=str(self.device),
                                     mbytes=ref.nbytes / 1e6, first_ms=first_ms if key == "ipc" and k == 0 else None,
                                     **_stats(ms)))
                probes.ack_ipc(held_acks, 10)
                if registered:
                    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
                plain.release([info.id])
        if reader is not self.reader:
            reader.close()
        return dict(rows=rows, checks=checks, notes=notes)

    def _register(self, buf: torch.Tensor, notes: list[str]) -> bool:
        if self.device.type != "cuda":
            return False
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.nbytes, 0)
        if int(getattr(err, "value", err)) != 0:
            notes.append(f"cudaHostRegister of the alloc_rows buffer failed ({err}): the shm row is a pageable copy")
            return False
        return True

    def connector(self) -> dict:
        rows, checks = [], []
        with self.client(ipc="off") as plain:
            (info,) = plain.encode([jpeg(*SIZES["1080p"], seed=7100)], wait=True)
            ref = plain.fetch([(info.id, 0)], 0, info.num_tokens).rows
            for mode in ("ipc", "shm"):
                times, served = self._connector_loads(info, ref, "auto" if mode == "ipc" else "off", "auto",
                                                      checks, mode)
                rows.append(dict(mode=mode, served=served, consumer=str(self.device), mbytes=ref.nbytes / 1e6,
                                 **{key: _stats(v) for key, v in times.items()}))
            plain.release([info.id])
        return dict(rows=rows, checks=checks)

    def _connector_loads(self, info, ref: torch.Tensor, ipc: str, channel: str, checks: list[str],
                         label: str) -> tuple[dict, str]:
        """The connector's cached item onto the device, n times (after 2 warm-up loads): ms staged (scheduler
        side), on the device (worker), total; and how its last load was served."""
        from encoder_service.integrations.vllm.fetch import RowFetcher
        from encoder_service.integrations.vllm.ipc_loads import IpcLoader
        from encoder_service.integrations.vllm.options import ConnectorOptions
        from encoder_service.integrations.vllm.staging import Need, StagingTable
        from encoder_service.integrations.vllm.worker import IpcRows, RowLoader
        from encoder_service.rowpath.cuda_ipc import KIND

        width = ref.shape[1]
        options = ConnectorOptions(self.job["url"], shm="on", shm_dir=self.job["shm_dir"], ipc=ipc,
                                   ipc_channel=channel, fetch_timeout_s=120.0)
        table = StagingTable(RowFetcher(options, width, ipc_kind=getattr(self.reader, "kind", KIND)))
        loader = RowLoader(self.device, ref.dtype, ipc=IpcLoader(options, self.device, reader=self.reader))
        need, times = Need(info.id, info.id, info.num_tokens), {"staged": [], "device": [], "total": []}
        try:
            for i in range(self.n + 2):
                rid = f"{label}-{i}"
                t0 = time.perf_counter()
                deadline = time.monotonic() + 120
                while not table.ensure(rid, [need]):
                    if table.why(rid) or time.monotonic() > deadline:
                        raise RuntimeError(table.why(rid) or "not staged in 120 s")
                    time.sleep(POLL_S)
                t1 = time.perf_counter()
                table.allocated(rid, need.identifier, need.num_rows)
                (load,) = table.end_step()
                got = loader.load(load, width)
                self.sync()
                t2 = time.perf_counter()
                if loader.ipc is not None:  # what the connector passes on (worker -> scheduler)
                    table.fetcher.copied(loader.ipc.take_copied())
                if i == 0 and not torch.equal(got.cpu(), ref):
                    checks.append(f"connector {label}: rows on {self.device} differ from the socket fetch's")
                if i >= 2:
                    for key, dt in (("staged", t1 - t0), ("device", t2 - t1), ("total", t2 - t0)):
                        times[key].append(dt * 1e3)
                table.finished(rid)
                table.end_step(freed=[need.identifier])  # vLLM dropped it: staged again next time
            return times, "ipc" if isinstance(load.rows, IpcRows) else table.fetcher.staging_mode
        finally:
            table.close()
            loader.close()

    def channel(self, runs: int) -> dict:
        """Part 5: the same-host channel against HTTP, `runs` runs of each in turn: the cached 1080p entry into
        the device `out` by IPC (our client's fetch), and the vLLM connector's load of it (total), p50 ms."""
        rows, checks = [], []
        with self.client(ipc="off") as plain:
            (info,) = plain.encode([jpeg(*SIZES["1080p"], seed=7400)], wait=True)
            item, n = [(info.id, 0)], info.num_tokens
            ref = plain.fetch(item, 0, n).rows
            out = torch.empty_like(ref, device=self.device)
            for run in range(runs):
                for way in ("channel", "http"):
                    with self.client(ipc=self.reader, ipc_channel=way == "channel") as c:
                        out.fill_(float("nan"))
                        ms = _timed(lambda: c.fetch(item, 0, n, out=out), self.n, self.sync)
                        paths = dict(c.fetch_paths)
                    if not torch.equal(out.cpu(), ref):
                        checks.append(f"channel run {run} {way}: rows on {self.device} differ from the socket fetch's")
                    times, served = self._connector_loads(info, ref, "auto", "auto" if way == "channel" else "off",
                                                          checks, f"{way}-{run}")
                    rows.append(dict(run=run, way=way, consumer=str(self.device), mbytes=ref.nbytes / 1e6,
                                     fetch=_stats(ms), fetch_paths=paths, connector=_stats(times["total"]),
                                     connector_served=served))
            plain.release([info.id])
        return dict(rows=rows, checks=checks)

    def e2e(self, variant: str, concurrency: int, seconds: float) -> dict:
        bases = [jpeg(*SIZES["720p"], seed=7200 + k) for k in range(8)]
        images = (stamped(bases[i % len(bases)], f"{variant} {i}") for i in itertools.count())
        flow = "e2e-hold" if variant == "ipc-hold" else "e2e"
        rec = asyncio.run(closed_loop([dict(http=self.job["url"])], images, concurrency, seconds, 120.0, flow=flow,
                                      out_device=str(self.device),
                                      client_kw=dict(ipc="off" if variant == "socket" else self.reader)))
        done, wall = len(rec["latencies"]), rec["t1"] - rec["t0"]
        return dict(variant=variant, concurrency=concurrency, consumer=str(self.device), requests=done,
                    errors=len(rec["errors"]), error_samples=rec["errors"][:3], images_per_s=done / wall,
                    p50_ms=percentile(rec["latencies"], 50), fetch_p50_ms=percentile(rec["fetch_ms"]["same"], 50),
                    fetch_paths=rec["fetch_paths"], loop_cpu_s=rec["loop_cpu_s"], wall_s=wall)


def consumer_main(job_path: str) -> int:
    """Commands on stdin, one JSON answer line each: paths | connector | channel <runs> |
    e2e <ipc|socket|ipc-hold> <concurrency> <s>."""
    consumer = Consumer(json.loads(Path(job_path).read_text()))
    print(json.dumps(dict(ready=True)), flush=True)
    for line in sys.stdin:
        command = line.split()
        try:
            if command[0] == "e2e":
                answer = consumer.e2e(command[1], int(command[2]), float(command[3]))
            elif command[0] == "channel":
                answer = consumer.channel(int(command[1]))
            else:
                answer = getattr(consumer, command[0])()
            print(json.dumps(answer), flush=True)
        except Exception as exc:  # noqa: BLE001 - the parent records it; the next command still runs
            print(children.failure(exc), flush=True)
    return 0


# ---- this process: the service, the model alone, the parts ---------------------------------------------------
def model_and_arena(core, device, small: bool) -> dict:
    """Part 1: the model alone on 720p images (benchmarks/common/model_alone.py: the reference of part 4); the
    arena's device copy and the engine's host copy per image on one engine batch of them; the runner's images/s
    with the arena copy added."""
    from encoder_service.engine.scheduler import batch_budget
    from encoder_service.runtime.transfer import HostCopier

    cfg = dict(max_calls=20 if small else 200, seconds=0.5 if small else 2.0)
    pvs, grids = engine_inputs(core, [jpeg(*SIZES["720p"], seed=7300 + k) for k in range(4)])
    alone = model_alone(core.runner, pvs, grids, device, batches=SMALL_BATCHES if small else BATCHES, **cfg)
    runner, arena = core.runner, core.ipc.arena
    batch = max(1, batch_budget(core.settings.engine.batch_tokens, runner.buckets) // pvs[0].shape[0])
    pvs, grids = pvs[:1] * batch, grids[:1] * batch
    outputs = runner.encode(pvs, grids)
    sync(device)
    n, copier = cfg["max_calls"] // 4, HostCopier()  # one copier: its host pool reused, as the engine's is
    row = dict(batch=batch, row_mb=outputs[0].nbytes / 1e6)
    row["host_copy_ms_per_image"] = percentile(_timed(lambda: copier.start(outputs).wait(), n, lambda: None),
                                               50) / batch
    with_arena = [lambda: runner.encode(pvs, grids)]
    if arena is not None:
        row["arena_copy_ms_per_image"] = percentile(_timed(lambda: arena.store(outputs), n,
                                                           lambda: sync(device)), 50) / batch
        with_arena.append(lambda: arena.store(runner.encode(pvs, grids)))
    for key, fn in zip(("model", "model_and_arena_copy"), with_arena):
        row[f"{key}_images_per_s"] = batch / (percentile(_timed(fn, n, lambda: sync(device)), 50) / 1e3)
    return dict(alone=alone, arena=row, solo=getattr(runner, "solo_timings", None))


class Run:
    """The parts and what they found; `save()` writes the JSON and markdown so far (a run cut short by the
    device's time limit still leaves what it measured)."""

    def __init__(self, args, device, dtype):
        self.args, self.device, self.dtype = args, device, dtype
        self.start = time.monotonic()
        self.checks, self.notes, self.skipped = [], [], []
        self.parts: dict = {}
        self.setup: dict = {}
        self.server: dict = {}

    def save(self) -> str:
        report = markdown(self.setup, self, self.server)
        write_result("ipc_bench", self.setup, dict(parts=self.parts, server_metrics=self.server, checks=self.checks,
                                                   notes=self.notes, skipped=self.skipped), report)
        return report

    def part(self, name: str, fn) -> None:
        """fn()'s result as part `name`, unless the budget can't hold it or it fails (both recorded)."""
        left = self.args.budget_s - (time.monotonic() - self.start)
        if not self.args.small and ESTIMATE_S.get(name.split()[0], 10) > left:
            self.skipped.append(f"{name} (needs ~{ESTIMATE_S.get(name.split()[0], 10)} s, {left:.0f} s left)")
            return
        t0 = time.monotonic()
        try:
            self.parts[name] = fn()
        except Exception as exc:  # noqa: BLE001 - a failed part is a failed check; the next part runs
            self.checks.append(f"{name} failed: {type(exc).__name__}: {exc}"[:500])
        print(f"{name}: {time.monotonic() - t0:.1f} s", flush=True)
        self.save()


def consumer_devices(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["cpu"]
    return ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny Qwen3-VL on the CPU, the arena's host stand-in")
    parser.add_argument("--concurrency", type=int, help="part 4's closed loop (default 64; --small 4)")
    parser.add_argument("--e2e-s", type=float, help="seconds of each part-4 variant (default 15; --small 3)")
    parser.add_argument("--budget-s", type=float, default=235.0,
                        help="seconds from the start: parts that would end past them are skipped (default 235)")
    parser.add_argument("--runs", type=int, help="part 5's runs of the channel and of HTTP (default 5; --small 2)")
    parser.add_argument("--consumer", metavar="JOB_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.consumer:
        return consumer_main(args.consumer)
    concurrency = args.concurrency or (4 if args.small else 64)
    e2e_s = args.e2e_s or (3.0 if args.small else 15.0)
    runs = args.runs or (2 if args.small else 5)
    n = int(os.environ.get("N", "3" if args.small else "30"))

    from encoder_service.api.service import bind_socket, build_core
    from encoder_service.testing.host_ipc import HostStandInMemory

    device, dtype = bench_device(args.small, parser)
    run = Run(args, device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        checkpoint.mkdir()
        if args.small:
            from encoder_service.testing.tiny import build_tiny_checkpoint

            build_tiny_checkpoint(FAMILY, checkpoint)
        else:
            build_checkpoint(FAMILY, False, device, dtype, checkpoint)
        http_sock = bind_socket("127.0.0.1", 0)
        small_flags = ("--ipc-arena-bytes", "256MiB") if args.small else ()
        settings = service_settings(checkpoint, device, dtype, http_sock, "--cache-bytes",
                                    "2GiB" if args.small else "24GiB", "--shm-fetch", *small_flags, grpc=False)
        core = build_core(settings, ipc_memory=HostStandInMemory.factory(tmp) if args.small else None)
        arena = core.ipc.metadata()
        print(f"core built in {time.monotonic() - run.start:.1f} s; arena: {arena}", flush=True)
        if arena is None:
            run.notes.append("no device row arena (see the log): every IPC row below fell back")
        run.setup = setup_info(device, dtype, args.small) | dict(
            model=f"tiny {FAMILY}" if args.small else f"{NAMES[FAMILY]} vision tower", arena=arena, iterations=n,
            gpus=torch.cuda.device_count() if device.type == "cuda" else 0, cpu_count=os.cpu_count())
        run.part("model alone and the arena's copy", lambda: model_and_arena(core, device, args.small))
        svc = in_process_service(settings, http_sock, core=core)
        try:
            for consumer in consumer_devices(device):
                job = Path(tmp) / f"consumer-{consumer.replace(':', '')}.json"
                source = "cpu" if args.small else "cuda:0"  # the service's GPU, as the consumer numbers it
                job.write_text(json.dumps(dict(url=svc.url, device=consumer, source=source, n=n,
                                               shm_dir=settings.server.shm_dir,
                                               standin_dir=tmp if args.small else None)))
                proc = children.start("benchmarks.ipc_bench", "--consumer", str(job))
                try:
                    children.answer(proc, time.monotonic() + 120)
                    for part, command in (("paths", "paths"), ("connector", "connector"),
                                          ("channel", f"channel {runs}")):
                        run.part(f"{part} {consumer}", lambda c=command: _ask(proc, c, run))
                    if consumer == consumer_devices(device)[-1]:
                        for variant in ("ipc", "ipc-hold", "socket"):
                            run.part(f"e2e {variant} {consumer}",
                                     lambda v=variant: _ask(proc, f"e2e {v} {concurrency} {e2e_s}", run))
                finally:
                    children.finish([proc])
            run.server = _ipc_metrics(svc.url)
        finally:
            svc.close()
    print(run.save())
    return 1 if run.checks else 0


def _ask(proc: subprocess.Popen, command: str, run: Run) -> dict:
    children.tell(proc, command)
    got = children.answer(proc, time.monotonic() + 600)
    run.checks += got.pop("checks", [])
    run.notes += got.pop("notes", [])
    return got


def _ipc_metrics(url: str) -> dict:
    """The server's encoder_ipc_* samples (labelled ones as name{label=value})."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name + "".join(f"{{{k}={v}}}" for k, v in s.labels.items()): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("encoder_ipc") or (s.name == "encoder_requests_total"
                                                    and s.labels.get("transport") == "channel")}


# ---- the report ---------------------------------------------------------------------------------------------
def _f(v, fmt=".2f") -> str:
    return "n/a" if v is None or v != v else format(v, fmt)


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def _head(title: str, *columns: str, note: str | None = None) -> list[str]:
    """A section's title, a note under it, and its table's header."""
    return [title, ""] + ([note, ""] if note else []) + ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def markdown(setup: dict, run: Run, server: dict) -> str:
    p = run.parts
    lines = ["# Rows GPU to GPU on one host (issue 34)", "", ", ".join(f"{k}: {v}" for k, v in setup.items()), ""]
    model = p.get("model alone and the arena's copy")
    if model:
        a = model["arena"]
        alone = model["alone"]
        lines += _head("## 1. Model alone (720p images on the device, per batch; the reference of part 4)",
                       "batch (images)", "patches", "runner route", "ms / batch", "images/s",
                       note=f"The model alone at its best batch: {reference_text(alone)}.")
        lines += [f"| {r['batch']} | {r['patches']} | {r['route']} | {r['ms']:.2f} | {r['images_per_s']:.1f} |"
                  for r in alone["rows"]]
        lines += [""] + _head("And the arena's copy, on one engine batch", "batch", "MB of rows / image",
                              "runner images/s", "with the arena copy images/s", "arena copy ms / image",
                              "host copy (D2H + out of staging) ms / image")
        lines += [f"| {a['batch']} | {a['row_mb']:.3g} | {_f(a.get('model_images_per_s'), '.1f')} "
                  f"| {_f(a.get('model_and_arena_copy_images_per_s'), '.1f')} "
                  f"| {_f(a.get('arena_copy_ms_per_image'), '.3f')} "
                  f"| {_f(a['host_copy_ms_per_image'], '.3f')} |", ""]
        if model.get("solo"):
            solo = "; ".join(f"{b}: {t['images']} x {t['alone_ms']:.2f} vs {t['packed_ms']:.2f} "
                             f"({t.get('packed_route', 'multi')}) -> {'alone' if t['solo'] else 'packed'}"
                             for b, t in model["solo"].items())
            lines += [f"Exact buckets, k images alone (k replays) against packed (as the runner would run them), "
                      f"ms: {solo}", ""]
    paths = [r for name, part in p.items() if name.startswith("paths") for r in part["rows"]]
    if paths:
        lines += _head("## 2. All rows of one cached entry into a device `out` in another process, ms", "image", "MB",
                       "consumer", "path", "served by", "p50", "p90", "min", "first fetch (opens the handle)")
        lines += [f"| {r['image']} | {r['mbytes']:.3g} | {r['consumer']} | {r['path']} | {r['served']} "
                  f"| {_f(r['p50_ms'])} | {_f(r['p90_ms'])} | {_f(r['min_ms'])} | {_f(r['first_ms'])} |" for r in paths]
        big = [r for r in paths if r["key"] == "ipc" and r["image"] == "1080p" and r["consumer"] != "cpu"]
        for r in big:
            lines.append(f"\nGoal: 1080p by IPC into {r['consumer']} <= {GOALS['fetch_ms']} ms: p50 "
                         f"{_f(r['p50_ms'])} ms, {_met(r['p50_ms'] <= GOALS['fetch_ms'] and r['served'] == 'ipc')}.")
        lines.append("")
    conn = [r for name, part in p.items() if name.startswith("connector") for r in part["rows"]]
    if conn:
        lines += _head("## 3. vLLM connector, cached 1080p image (warm) onto the worker's device, ms (p50 / p90)",
                       "consumer", "mode", "served by", "MB", "staged (scheduler side)", "on the device (worker)",
                       "total")
        lines += [f"| {r['consumer']} | {r['mode']} | {r['served']} | {r['mbytes']:.3g} | "
                  + " | ".join(f"{_f(r[k]['p50_ms'])} / {_f(r[k]['p90_ms'])}" for k in ("staged", "device", "total"))
                  + " |" for r in conn]
        for r in (r for r in conn if r["mode"] == "ipc" and r["consumer"] != "cpu"):
            lines.append(f"\nGoal: connector by IPC <= {GOALS['connector_ms']} ms ({r['consumer']}): p50 total "
                         f"{_f(r['total']['p50_ms'])} ms, "
                         f"{_met(r['total']['p50_ms'] <= GOALS['connector_ms'] and r['served'] == 'ipc')}.")
        lines.append("")
    e2e = [part for name, part in p.items() if name.startswith("e2e")]
    if e2e:
        ref = model["alone"]["images_per_s"] if model else None
        lines += _head("## 4. End to end: distinct 720p JPEGs, encode wait=true, all rows into a device `out`, "
                       "release; one client process", "fetch", "consumer", "concurrency", "requests", "errors",
                       "images/s", "% of model alone", "p50 ms", "fetch p50 ms", "fetches by path", "client loop CPU s",
                       note=f"% of the model alone: {reference_text(model['alone'])}." if model else None)
        for r in e2e:
            share = 100 * r["images_per_s"] / ref if ref else None
            lines.append(f"| {r['variant']} | {r['consumer']} | {r['concurrency']} | {r['requests']} | {r['errors']} "
                         f"| {r['images_per_s']:.1f} | {_f(share, '.0f')}% | {_f(r['p50_ms'], '.1f')} "
                         f"| {_f(r['fetch_p50_ms'])} | {r['fetch_paths']} | {_f(r['loop_cpu_s'], '.1f')} |")
        ipc = next((r for r in e2e if r["variant"] == "ipc"), None)
        if ipc and ref and setup.get("sizes") == "real":
            lines.append(f"\nGoal: >= {100 * GOALS['e2e_fraction']:.0f}% of the model alone: "
                         f"{100 * ipc['images_per_s'] / ref:.0f}%, "
                         f"{_met(ipc['images_per_s'] >= GOALS['e2e_fraction'] * ref)}.")
        lines.append("")
    channel = [r for name, part in p.items() if name.startswith("channel") for r in part["rows"]]
    if channel:
        lines += _head("## 5. The same-host channel against HTTP (issue 40): the cached 1080p entry into a device "
                       "`out` by IPC, and the vLLM connector's load of it, p50 ms per run", "run", "consumer", "way",
                       "MB", "fetch p50", "fetch p90", "fetches by path", "connector p50 (total)", "connector by")
        lines += [f"| {r['run'] + 1} | {r['consumer']} | {r['way']} | {r['mbytes']:.3g} "
                  f"| {_f(r['fetch']['p50_ms'], '.3f')} | {_f(r['fetch']['p90_ms'], '.3f')} | {r['fetch_paths']} "
                  f"| {_f(r['connector']['p50_ms'], '.3f')} | {r['connector_served']} |" for r in channel]
        for consumer in dict.fromkeys(r["consumer"] for r in channel if r["consumer"] != "cpu"):
            mine = [r for r in channel if r["consumer"] == consumer and r["way"] == "channel"]
            for key, goal, what in (("fetch", CHANNEL_GOALS["fetch_ms"], "fetch by IPC"),
                                    ("connector", CHANNEL_GOALS["connector_ms"], "vLLM connector")):
                met = sum(r[key]["p50_ms"] <= goal for r in mine)
                lines.append(f"\nGoal: {what} over the channel into {consumer} p50 <= {goal} ms in every run: "
                             f"{met} of {len(mine)}, {_met(met == len(mine))}.")
        lines.append("")
    lines += ["Server's IPC counters: " + ", ".join(f"{k} {v:g}" for k, v in server.items()), ""]
    lines += [f"> {n}" for n in dict.fromkeys(run.notes)]
    if run.skipped:
        lines.append("Skipped (budget): " + "; ".join(run.skipped))
    lines.append("Checks: " + ("all passed" if not run.checks else "; ".join(run.checks)))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.chdir(ROOT)  # the consumers run as `python -m benchmarks.ipc_bench` from here
    sys.exit(main())
