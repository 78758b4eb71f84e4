"""Video through the service (issue 21, item 5): a 60 s 720p clip at 2 fps (made here with PyAV: 120 frames,
moving texture, H.264), sampled at 2 fps, for Qwen2.5-VL-7B and Qwen3-VL-8B at their real sizes (random weights,
bfloat16, the service's CUDA graphs; the released checkpoints' video preprocessing).

Per family, in one run:
  1. the service (core + HTTP + gRPC on 127.0.0.1, this process; gRPC client): from the encode request to the
     rows of the first prefill chunk (2048 prompt tokens: the frame groups it overlaps), and to all rows, chunk
     after chunk as a chunked prefill reads them (Qwen2.5-VL: one run of the video's tokens; Qwen3-VL: each
     frame group after 8 tokens of timestamp text). A distinct clip per run (no cache hit).
  2. transformers, same clip: PyAV decodes every frame (as its reader does), its video processor
     (`AutoVideoProcessor`, `device=` the GPU: needs torchvision; else ours, which equals it bit for bit,
     tests/engines/test_torchvision_video.py, and the table says so) and its vision tower on the whole video
     in one call (sdpa). Its first rows are its last: no chunk can start before the whole video is encoded.
     Its rows are the reference the service's are checked against (relative errors, bf16).
  3. frames per second through the service at concurrency 8: 8 workers encode distinct 10 s clips with
     wait=true; sampled frames / wall time (and frame groups per ViT batch from /metrics).

    python -m benchmarks.video_bench            # GPU: both families, under 5 minutes on an H100
    python -m benchmarks.video_bench --small    # CPU: tiny towers, an 8 s 160x90 clip (runs anywhere)
    python -m benchmarks.video_bench --families qwen3_vl --runs 5

Prints a markdown table; writes benchmarks/results/video_bench-<date>-<commit>.json and $OUT/video_bench.md
(benchmarks/common/report.py). Exits 1 when a check fails: the service's grid or rows against transformers'
(norm relative error over MAX_NORM_REL_ERR), a request error, rows missing from a chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.device import bench_device, sync
from benchmarks.common.images import photo
from benchmarks.common.models import NAMES, build_checkpoint, reference_rows
from benchmarks.common.report import setup_info, write_result
from benchmarks.common.service import in_process_service, service_settings

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
MAX_NORM_REL_ERR = 2e-2  # bf16 against transformers' bf16 tower: both round differently
CHUNK = 2048  # prompt tokens per prefill chunk
TEXT_BEFORE, TIMESTAMP_TOKENS = 16, 8  # prompt tokens before the video; Qwen3-VL's text before each group
CONFIGS = {  # clip (seconds, width, height, fps), throughput clips (count, seconds), cache
    "full": dict(clip=(60, 1280, 720, 2), throughput=(16, 10), cache_bytes="24GiB"),
    "small": dict(clip=(8, 160, 90, 2), throughput=(8, 4), cache_bytes="1GiB"),
}
# Qwen3-VL-8B's published video_preprocessor_config.json (Qwen2.5-VL-7B has none: its videos use the image
# file); --small: a budget of 16 frames of 64 tokens.
QWEN3_VIDEO = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "temporal_patch_size": 2,
               "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_sample_frames": True,
               "fps": 2, "size": {"longest_edge": 25165824, "shortest_edge": 4096}}
QWEN3_VIDEO_SMALL = QWEN3_VIDEO | {"size": {"longest_edge": 16 * 64 * 32 * 32, "shortest_edge": 4096}}


def make_clip(seconds: int, width: int, height: int, fps: int, seed: int) -> bytes:
    """An H.264 MP4 of `seconds` at `fps`: photo-like texture drifting frame to frame; `seed`: other bytes."""
    import av

    base = photo(width + 4 * seconds * fps, height, seed)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "crf": "23"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            frame = np.ascontiguousarray(base[:, 4 * i:4 * i + width])
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def decode_all(data: bytes) -> tuple[np.ndarray, dict]:
    """Every frame [N, H, W, 3] uint8 and the metadata transformers' PyAV reader would give."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        fps = float(stream.average_rate)
    n, h, w, _ = frames.shape
    return frames, {"total_num_frames": n, "fps": fps, "width": w, "height": h, "duration": n / fps,
                    "frames_indices": list(range(n))}


class Reference:
    """transformers' video processor (or, without torchvision, ours) and tower on a whole video."""

    def __init__(self, checkpoint: Path, model, device: torch.device, dtype: torch.dtype, cfg):
        """`cfg`: the checkpoint's VideoConfig (ours: what the fallback preprocesses with)."""
        self.model, self.device, self.dtype, self.cfg = model, device, dtype, cfg
        try:
            from transformers import AutoVideoProcessor

            self.processor = AutoVideoProcessor.from_pretrained(checkpoint)
            self.preprocess = "transformers"
        except ImportError:  # transformers' video processors import torchvision
            self.processor = None
            self.preprocess = "ours (no torchvision): bit-exact with transformers' on the CPU"

    @torch.no_grad()
    def encode(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int, int]]:
        frames, metadata = decode_all(data)
        if self.processor is not None:
            out = self.processor(frames, video_metadata=metadata, do_sample_frames=True, fps=2, return_tensors="pt",
                                 device=str(self.device))
            pixels, grid = out["pixel_values_videos"], out["video_grid_thw"]
        else:
            pixels, grid = self._ours(data)
        rows = reference_rows(self.model(pixels.to(self.device, self.dtype), grid_thw=grid.to(self.device)))
        sync(self.device)
        return rows, tuple(int(x) for x in grid[0])

    def _ours(self, data: bytes):
        from encoder_service.preprocessing import (
            VideoLimits, VideoOptions, iter_frame_groups, plan_video, preprocess_group, probe_video,
        )  # fmt: skip

        limits = VideoLimits(max_bytes=1 << 30)
        plan = plan_video(probe_video(data, limits), self.cfg, VideoOptions(fps=2), limits)
        groups = [preprocess_group(f, plan, self.cfg, device=self.device)
                  for f in iter_frame_groups(data, plan, limits)]
        return torch.cat(groups), torch.tensor([plan.grid_thw])


def prompt_items(info) -> tuple[list[tuple[str, int, int]], int]:
    """(group id, offset, rows) per frame group as a prompt lays them out, and the prompt's length."""
    if info.group_timestamps is None:  # Qwen2/2.5-VL: one run
        items = info.fetch_items(TEXT_BEFORE)
    else:  # Qwen3-VL: timestamp text + vision start before each group, vision end after
        step = info.tokens_per_group + TIMESTAMP_TOKENS + 2
        first = TEXT_BEFORE + TIMESTAMP_TOKENS + 1
        items = info.fetch_items(offsets=[first + g * step for g in range(info.num_groups)])
    return items, items[-1][1] + info.tokens_per_group + 8


def service_run(client, data: bytes) -> dict:
    """One encode and a chunked prefill's fetches: ms to the first chunk's rows and to all, and the rows."""
    from encoder_service.ranges import overlapping

    t0 = time.perf_counter()
    (info,) = client.encode_videos([data], fps=2)
    t_answer = time.perf_counter()
    items, prompt_len = prompt_items(info)
    rows, first_ms = [], None
    for start in range(0, prompt_len, CHUNK):
        end = min(start + CHUNK, prompt_len)
        wanted = overlapping(items, start, end)
        if not wanted:
            continue
        fetched = client.fetch(wanted, start, end)
        if sum(s.num_rows for s in fetched.segments) != fetched.rows.shape[0]:
            raise AssertionError(f"chunk [{start}, {end}): rows and segments disagree")
        rows.append(fetched.rows)
        if first_ms is None:
            first_ms = (time.perf_counter() - t0) * 1e3
    all_ms = (time.perf_counter() - t0) * 1e3
    client.release([info.id])
    return dict(info=info, answer_ms=(t_answer - t0) * 1e3, first_ms=first_ms, all_ms=all_ms, rows=torch.cat(rows))


async def throughput(address: str, clips: list[bytes], concurrency: int) -> dict:
    from encoder_service.client import AsyncEncoderClient

    frames, errors = 0, []
    queue = iter(clips)
    async with AsyncEncoderClient.grpc(address, timeout=600) as client:
        start = time.perf_counter()

        async def worker():
            nonlocal frames
            for data in queue:
                try:
                    (info,) = await client.encode_videos([data], wait=True, fps=2)
                    frames += info.num_frames
                    await client.release([info.id])
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return dict(videos=len(clips), frames=frames, wall_s=wall, frames_per_s=frames / wall, errors=errors)


def rel_errors(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max|d| / max|ref|, ||d|| / ||ref||), d = ours - ref."""
    ours, ref = ours.double().cpu(), ref.double().cpu()
    diff = ours - ref
    return (diff.abs().max() / ref.abs().max()).item(), (diff.norm() / ref.norm()).item()


def batch_groups(url: str) -> float | None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    batches = samples.get("encoder_encode_seconds_count", 0.0)
    return samples.get("encoder_images_encoded_total", 0.0) / batches if batches else None


def bench_family(family: str, small: bool, runs: int, device, dtype, tmp: Path) -> tuple[dict, list[str]]:
    from encoder_service.client import EncoderClient

    config = CONFIGS["small" if small else "full"]
    seconds, width, height, fps = config["clip"]
    checkpoint = tmp / family
    checkpoint.mkdir()
    model = build_checkpoint(family, small, device, dtype, checkpoint, keep=True)
    if family == "qwen3_vl":
        video = QWEN3_VIDEO_SMALL if small else QWEN3_VIDEO
        (checkpoint / "video_preprocessor_config.json").write_text(json.dumps(video))
    t0 = time.perf_counter()
    clips = [make_clip(seconds, width, height, fps, seed=100 * FAMILIES.index(family) + i) for i in range(runs)]
    count, short_s = config["throughput"]
    short = [make_clip(short_s, width, height, fps, seed=10_000 + 100 * FAMILIES.index(family) + i)
             for i in range(count)]
    clips_s = time.perf_counter() - t0
    failures: list[str] = []

    sock = socket.create_server(("127.0.0.1", 0))
    settings = service_settings(checkpoint, device, dtype, sock, "--cache-bytes", config["cache_bytes"],
                                "--max-video-bytes", "256MiB", "--max-body-bytes", "256MiB")
    service = in_process_service(settings, sock)
    try:
        reference = Reference(checkpoint, model, device, dtype, service.core.videos.reader.cfg)
        reference.encode(clips[0])  # warm-up (kernels, allocator)
        ref_ms, ref_rows, ref_grid = [], None, None
        for _ in range(max(1, runs - 1)):
            t = time.perf_counter()
            ref_rows, ref_grid = reference.encode(clips[0])
            ref_ms.append((time.perf_counter() - t) * 1e3)
        del model, reference.model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with EncoderClient.grpc(service.grpc_address, timeout=600) as client:
            service_run(client, make_clip(2, width, height, fps, seed=99_999))  # warm-up: a short distinct clip
            results = [service_run(client, data) for data in clips]
        info = results[0]["info"]
        if info.video_grid_thw != ref_grid:
            failures.append(f"{family}: grid {info.video_grid_thw}, transformers' {ref_grid}")
            max_err = norm_err = float("nan")
        else:
            max_err, norm_err = rel_errors(results[0]["rows"], ref_rows)
            if not norm_err <= MAX_NORM_REL_ERR:
                failures.append(f"{family}: rows' norm rel err {norm_err:.2e} > {MAX_NORM_REL_ERR}")
        busy = asyncio.run(throughput(service.grpc_address, short, 8))
        failures += [f"{family} throughput: {e}" for e in busy["errors"][:3]]
        per_batch = batch_groups(service.url)
    finally:
        service.close()
    med = statistics.median
    row = dict(family=family, model=NAMES[family], grid=list(info.video_grid_thw), num_frames=info.num_frames,
               num_tokens=info.num_tokens, tokens_per_group=info.tokens_per_group,
               answer_ms=med([r["answer_ms"] for r in results]), first_chunk_ms=med([r["first_ms"] for r in results]),
               all_rows_ms=med([r["all_ms"] for r in results]), runs=[{k: r[k] for k in ("answer_ms", "first_ms",
                                                                                         "all_ms")} for r in results],
               transformers_ms=med(ref_ms), transformers_runs=ref_ms, reference_preprocess=reference.preprocess,
               max_rel_err=max_err, norm_rel_err=norm_err, throughput=busy, groups_per_batch=per_batch,
               clips_s=clips_s)
    return row, failures


def markdown(setup: dict, rows: list[dict], failures: list[str]) -> str:
    lines = [f"video_bench {json.dumps(setup)}", "",
             "| model | clip | grid | tokens | answer ms | first chunk ms | all rows ms | transformers ms "
             "| first-chunk speedup | all-rows speedup | frames/s @ c8 | groups/batch | norm rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['num_frames']} frames | {r['grid']} | {r['num_tokens']} | {r['answer_ms']:.1f} "
            f"| {r['first_chunk_ms']:.1f} | {r['all_rows_ms']:.1f} | {r['transformers_ms']:.1f} "
            f"| {r['transformers_ms'] / r['first_chunk_ms']:.1f}x | {r['transformers_ms'] / r['all_rows_ms']:.1f}x "
            f"| {r['throughput']['frames_per_s']:.1f} | {r['groups_per_batch'] or float('nan'):.2f} "
            f"| {r['norm_rel_err']:.2e} |")
    lines += ["", f"transformers' preprocessing: {rows[0]['reference_preprocess']}" if rows else "",
              "checks: " + ("all passed" if not failures else "; ".join(failures))]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU, tiny towers and a small clip")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, of " + ", ".join(FAMILIES))
    parser.add_argument("--runs", type=int, default=3, help="timed runs per family (distinct clips)")
    args = parser.parse_args()
    device, dtype = bench_device(args.small, parser)
    families = [f for f in args.families.split(",") if f]
    if not families or set(families) - set(FAMILIES):
        parser.error(f"--families: choose from {', '.join(FAMILIES)}")
    setup = setup_info(device, dtype, args.small) | dict(clip=CONFIGS["small" if args.small else "full"]["clip"],
                                                         chunk=CHUNK, runs=args.runs)
    rows, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            row, failed = bench_family(family, args.small, args.runs, device, dtype, Path(tmp))
            rows.append(row)
            failures += failed
    table = markdown(setup, rows, failures)
    print(table)
    write_result("video_bench", setup, {"rows": rows, "failures": failures}, table)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
