"""The vLLM connector's path for one 1080p image, timed (issue 12, item 5): encode -> the connector's
scheduler-side fetch into host shared memory -> the rows on the worker's device, as in encoder_cache.

No vLLM here: the connector (encoder_service/integrations/vllm/connector.py) is a thin adapter over the
package's vLLM-free modules, and this drives them exactly as the adapter does: `StagingTable.ensure` (polled,
as vLLM's steps poll ensure_cache_available) until the item is staged, `allocated` + `end_step`
(update_state_after_alloc, build_connector_meta), then `RowLoader.load` on the device (start_load_caches),
synchronized.

Per family (Qwen2.5-VL-7B and Qwen3-VL-8B vision towers at real size, random weights, bf16, CUDA graphs: the
service's own build_core; --small: the tiny checkpoints on the CPU) and per way the rows travel (the encoder
writes them into our shared memory, or our client brings them over the HTTP or the gRPC socket):
  - cold: a new 1080p JPEG each iteration: encode (answers before the ViT) -> staged (waits for the ViT, then
    the transfer) -> on the device; the ViT dominates.
  - warm: the image already encoded and cached at the encoder, not staged by the connector: staged -> on the
    device. This is the connector's own cost.
  - device copy alone: one staged item to the device, from the arena registered with CUDA (the default) and
    from pageable memory (pin=False).
Median (and p90) of N iterations; every mode's loaded rows are checked bit for bit against a plain client fetch.

The service runs in this process (core + HTTP + gRPC on 127.0.0.1, --shm-fetch); the "vLLM side" runs in a
child process (this script with --side), as vLLM's EngineCore is another process than the encoder.

    python -m benchmarks.connector_bench            # GPU (needs CUDA)
    python -m benchmarks.connector_bench --small    # CPU smoke test
    N=50 python -m benchmarks.connector_bench       # iterations per mode (default 30; --small 5)

Writes benchmarks/results/connector_bench-<date>-<commit>.json and $OUT/connector_bench.md
(benchmarks/common/report.py: where, with and without OUT). Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.children import module_command, module_env
from benchmarks.common.device import bench_device, sync
from benchmarks.common.images import make_jpegs
from benchmarks.common.models import NAMES, build_checkpoint
from benchmarks.common.report import setup_info, write_result
from benchmarks.common.service import in_process_service, service_settings
from benchmarks.common.stats import percentile

SIZE = (1920, 1080)
MODES = ("shm", "http", "grpc")
POLL_S = 0.0002  # how often the side asks ensure() while an item is in flight (vLLM: once per engine step)


# ---- the vLLM side (child process) ----------------------------------------------------------------------
def _table(job: dict, mode: str, width: int):
    from encoder_service.integrations.vllm.fetch import RowFetcher
    from encoder_service.integrations.vllm.options import ConnectorOptions
    from encoder_service.integrations.vllm.staging import StagingTable

    url = "grpc://" + job["grpc"] if mode == "grpc" else job["http"]
    options = ConnectorOptions(url, shm="on" if mode == "shm" else "off", shm_dir=job["shm_dir"],
                               fetch_timeout_s=120.0)
    return StagingTable(RowFetcher(options, width))


def _staged(table, need, request_id: str) -> None:
    deadline = time.monotonic() + 120
    while not table.ensure(request_id, [need]):
        if table.why(request_id):
            raise RuntimeError(table.why(request_id))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{need.item_id} not staged in 120 s")
        time.sleep(POLL_S)


def _to_device(table, loader, need, request_id: str, width: int, device):
    table.allocated(request_id, need.identifier, need.num_rows)
    (load,) = table.end_step()
    rows = loader.load(load, width)
    sync(device)
    return rows, load


def _forget(table, need, request_id: str, release: bool) -> None:
    """vLLM is done with the item (it left its encoder cache): the connector drops its host copy (and, as at
    request_finished, releases the encode's pin when `release`)."""
    table.finished(request_id, [need.item_id] if release else [])
    table.end_step(freed=[need.identifier])


def _stats(samples: list[float]) -> dict:
    return dict(median_ms=percentile(samples, 50), p90_ms=percentile(samples, 90), min_ms=min(samples),
                n=len(samples))


def side_main(job_path: str) -> int:
    import torch

    from encoder_service.client import EncoderClient
    from encoder_service.integrations.vllm.staging import Need
    from encoder_service.integrations.vllm.worker import RowLoader
    from encoder_service.models.configs import row_width

    job = json.loads(Path(job_path).read_text())
    device = torch.device(job["device"])
    dtype = getattr(torch, job["dtype"])
    width = row_width(json.loads(Path(job["checkpoint"], "config.json").read_text()))
    n, base = job["n"], job["image_base"]
    jpegs = make_jpegs(SIZE, range(base, base + (n + 2) * len(MODES) + 1))
    results, checks, k = [], [], 0
    with EncoderClient.http(job["http"], timeout=120) as client:
        (warm_info,) = client.encode([jpegs[-1]], wait=True)
        reference = client.fetch([(warm_info.id, 0)], 0, warm_info.num_tokens).rows
        for mode in MODES:
            table = _table(job, mode, width)
            loader = RowLoader(device, dtype)
            try:
                # cold: a new image per iteration (the ViT runs); the first iteration is warm-up
                cold = {"encode": [], "staged": [], "device": [], "total": []}
                for i in range(n + 1):
                    t0 = time.perf_counter()
                    (info,) = client.encode([jpegs[k]])
                    k += 1
                    t1 = time.perf_counter()
                    need, rid = Need(info.id, info.id, info.num_tokens), f"cold-{mode}-{i}"
                    _staged(table, need, rid)
                    t2 = time.perf_counter()
                    _to_device(table, loader, need, rid, width, device)
                    t3 = time.perf_counter()
                    _forget(table, need, rid, release=True)
                    if i:
                        for name, dt in (("encode", t1 - t0), ("staged", t2 - t1), ("device", t3 - t2),
                                         ("total", t3 - t0)):
                            cold[name].append(dt * 1e3)
                # warm: the cached image (encoded again: the cold images may have pushed it out), fetched and
                # dropped again each iteration
                client.encode([jpegs[-1]], wait=True)
                warm = {"staged": [], "device": [], "total": []}
                need = Need(warm_info.id, warm_info.id, warm_info.num_tokens)
                for i in range(n + 1):
                    rid = f"warm-{mode}-{i}"
                    t1 = time.perf_counter()
                    _staged(table, need, rid)
                    t2 = time.perf_counter()
                    rows, load = _to_device(table, loader, need, rid, width, device)
                    t3 = time.perf_counter()
                    if i == 0 and not torch.equal(rows.cpu(), reference.to(dtype)):
                        checks.append(f"{job['family']} {mode}: rows on the device differ from the client's fetch")
                    if i:
                        for name, dt in (("staged", t2 - t1), ("device", t3 - t2), ("total", t3 - t1)):
                            warm[name].append(dt * 1e3)
                    if i < n:
                        _forget(table, need, rid, release=False)
                # the device copy alone, from the registered arena and from pageable memory
                copies = {}
                for pin in (True, False):
                    other = RowLoader(device, dtype, pin=pin)
                    other.load(load, width)
                    sync(device)
                    times = []
                    for _ in range(n):
                        t0 = time.perf_counter()
                        other.load(load, width)
                        sync(device)
                        times.append((time.perf_counter() - t0) * 1e3)
                    copies["pinned" if pin and other.pin else "pageable"] = _stats(times)
                    other.close()
                _forget(table, need, rid, release=True)
                row = dict(family=job["family"], mode=table.fetcher.mode, rows=warm_info.num_tokens, row_width=width,
                           mbytes=load.rows.nbytes / 1e6, dtype=load.rows.dtype,
                           cold={name: _stats(v) for name, v in cold.items()},
                           warm={name: _stats(v) for name, v in warm.items()}, device_copy=copies)
                if row["mode"] != mode:
                    checks.append(f"{job['family']}: asked for {mode}, the fetcher used {row['mode']}")
                results.append(row)
                print("side", json.dumps(row), flush=True)
            finally:
                loader.close()
                table.close()
    Path(job["result"]).write_text(json.dumps(dict(rows=results, checks=checks)))
    return 0


# ---- the service (this process) and the report ------------------------------------------------------------
def run_family(family: str, small: bool, device, dtype, n: int, tmp: Path, index: int) -> tuple[dict, list[str]]:
    import torch

    from encoder_service.api.service import bind_socket, build_core

    checkpoint = tmp / family
    checkpoint.mkdir()
    t0 = time.perf_counter()
    if small:
        from encoder_service.testing.tiny import build_tiny_checkpoint

        build_tiny_checkpoint(family, checkpoint)
    else:
        build_checkpoint(family, False, device, dtype, checkpoint)
    http_sock = bind_socket("127.0.0.1", 0)
    settings = service_settings(checkpoint, device, dtype, http_sock, "--cache-bytes", "8GiB", "--shm-fetch")
    core = build_core(settings)
    setup_s = time.perf_counter() - t0
    svc = in_process_service(settings, http_sock, core=core)
    try:
        job, result = tmp / f"{family}.job.json", tmp / f"{family}.result.json"
        job.write_text(json.dumps(dict(family=family, http=svc.url, grpc=svc.grpc_address, shm_dir="/dev/shm",
                                       device=str(device if device.type == "cpu" else "cuda:0"),
                                       dtype=str(dtype).removeprefix("torch."), checkpoint=str(checkpoint), n=n,
                                       image_base=1_000_000 * (index + 1), result=str(result))))
        before = core.shm.stats()
        proc = subprocess.run(module_command("benchmarks.connector_bench", "--side", str(job)), env=module_env(),
                              timeout=1800, check=False)
        if not result.exists():
            return dict(family=family, rows=[], setup_s=setup_s), [f"{family}: the vLLM side failed (exit "
                                                                   f"{proc.returncode})"]
        out = json.loads(result.read_text())
        after = core.shm.stats()
        writes = after["writes"] - before["writes"]
        for row in out["rows"]:  # only the shm mode's fetches had the encoder write into our files
            if row["mode"] == "shm" and writes:
                seconds, nbytes = (after[k] - before[k] for k in ("copy_seconds", "written_bytes"))
                row["server_copy"] = dict(writes=writes, mean_ms=seconds / writes * 1e3,
                                          gb_s=nbytes / seconds / 1e9 if seconds else None)
        return dict(family=family, rows=out["rows"], setup_s=setup_s, runner=core.runner.describe().get("runner")), \
            out["checks"]
    finally:
        svc.close()
        del core
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _copy_cell(copy: dict | None) -> str:
    if copy is None:
        return "-"
    rate = f", {copy['gb_s']:.1f} GB/s" if copy["gb_s"] else ""
    return f"{copy['mean_ms']:.2f} ms{rate} ({copy['writes']} writes)"


def markdown(setup: dict, families: list[dict], checks: list[str]) -> str:
    def s(d):
        return f"{d['median_ms']:.2f} ({d['p90_ms']:.2f})"

    lines = ["# vLLM connector path: one 1080p image, encode -> staged in host memory -> on the device", "",
             ", ".join(f"{k}: {v}" for k, v in setup.items()), "",
             "Milliseconds, median (p90). cold: a new image each time (the ViT runs inside 'staged'); warm: the "
             "image cached at the encoder; device copy: staged rows to the device alone.", "",
             "| family | rows travel by | rows x width | MB | cold encode | cold staged | cold on device | cold total "
             "| warm staged | warm on device | warm total | copy, registered | copy, pageable | encoder's copy into "
             "shm, mean of cold and warm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for fam in families:
        for r in fam["rows"]:
            c, w, d = r["cold"], r["warm"], r["device_copy"]
            lines.append(f"| {fam['name']} | {r['mode']} | {r['rows']} x {r['row_width']} {r['dtype']} "
                         f"| {r['mbytes']:.3g} | {s(c['encode'])} | {s(c['staged'])} | {s(c['device'])} "
                         f"| {s(c['total'])} | {s(w['staged'])} | {s(w['device'])} | {s(w['total'])} "
                         f"| {s(d['pinned']) if 'pinned' in d else 'n/a'} | {s(d['pageable'])} "
                         f"| {_copy_cell(r.get('server_copy'))} |")
    lines += ["", "Checks: " + ("all passed" if not checks else "; ".join(checks))]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny checkpoints, float32, CPU")
    parser.add_argument("--families", default=",".join(NAMES), help="comma-separated (default: both)")
    parser.add_argument("--side", metavar="JOB_JSON", help=argparse.SUPPRESS)  # the vLLM side (child)
    args = parser.parse_args()
    if args.side:
        return side_main(args.side)

    device, dtype = bench_device(args.small, parser)
    n = int(os.environ.get("N", "5" if args.small else "30"))
    families, checks = [], []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for index, family in enumerate(args.families.split(",")):
            fam, fam_checks = run_family(family, args.small, device, dtype, n, Path(tmp), index)
            fam["name"] = f"tiny {family}" if args.small else f"{NAMES[family]} vision tower"
            families.append(fam)
            checks += fam_checks
    setup = setup_info(device, dtype, args.small) | dict(iterations=n, image=f"{SIZE[0]}x{SIZE[1]} JPEG",
                                                         cpu_count=os.cpu_count())
    report = markdown(setup, families, checks)
    write_result("connector_bench", setup, dict(families=families, checks=checks), report)
    print(report)
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
