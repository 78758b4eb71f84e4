"""Decode and preprocess time per image on the GPU, Pillow vs nvJPEG: `--preprocess torchvision` (the default
on CUDA, exact) vs `--preprocess torchvision-nvjpeg` (opt-in), with `pil` for reference; the README's
"Preprocessing" numbers.

Images: distinct photo-like JPEGs (benchmarks/common/images.py: `jpeg`, quality 92), 720p and 1080p. Per
backend and size:
  decode ms      `backend.decode(data)`: the header check and the pixels, [3, H, W] uint8 on the device (Pillow:
                 decoded on this thread, then uploaded; nvJPEG: decoded on the GPU), synchronized; median
  preprocess ms  `backend.preprocess(data, bfloat16)`: decode, resize, normalize, patchify, cast, what the
                 engine runs per image on a CPU-pool thread (on its own stream); median
  images/s       `preprocess` of every image from the engine's pool size of threads at once (min(8, CPUs),
                 engine/engine.py), one pass after a warm-up
and the default backend's (`torchvision`) preprocess step by step, each step timed on its own (median ms,
synchronized): Pillow's decode to RGB, the [H, W, 3] array copy (transformers makes it too), its upload and CHW
copy on the device, resize/normalize/patchify there (the way every image but an upright RGB JPEG goes); then the
JPEGs' way: Pillow's decoder straight into pinned RGBX memory, its upload and CHW copy; the steps checked to make
the backend's pixel values, the two decodes to give the same pixels.
Checks (exit 1 when one fails): nvJPEG decodes every one of these JPEGs itself (no fallback to Pillow);
`torchvision` equals transformers' `Qwen2VLImageProcessor(device="cuda")` given the PIL image, and
`torchvision-nvjpeg` equals it given nvJPEG's pixels, bit for bit. nvJPEG's pixels against Pillow's: mean and
max |difference| in levels, reported.

    python -m benchmarks.preprocess_decode           # GPU, torchvision installed (nvJPEG); about a minute
    python -m benchmarks.preprocess_decode --small   # CPU smoke test: no nvJPEG (that backend decodes with
                                                     # Pillow), the checks that need it are skipped

Prints a markdown table; writes its JSON and preprocess_decode.md (benchmarks/common/report.py says where).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.common.device import bench_device, sync
from benchmarks.common.images import jpeg
from benchmarks.common.report import setup_info, write_result
from encoder_service.preprocessing import PreprocessConfig, jpeg_into, make_backend, plan, probe, torch_ops
from encoder_service.preprocessing.decode import decode_rgb, open_image
from encoder_service.preprocessing.nvjpeg import NvJpegDecoder
from tests.support.preprocess_cases import HUB_CONFIGS, LIMITS, config_and_processor, write_checkpoint

BACKENDS = ("torchvision", "torchvision-nvjpeg", "pil")
SIZES = {"720p": (1280, 720), "1080p": (1920, 1080)}
IMAGES = {"gpu": 48, "small": 4}  # distinct images per size
CHECKED = 4  # images per size checked against transformers
POOL_THREADS = min(8, os.cpu_count() or 2)  # the engine's CPU pool (engine/engine.py)
# `torchvision`'s preprocess, in order: the usual way to the device, then the JPEGs' (steps_ms)
STEPS = ("Pillow decode", "array copy", "upload", "pixel values", "Pillow decode into pinned", "upload from pinned")


def median_ms(call, datas, device) -> float:
    """Median ms of `call(data)` over `datas`, synchronized, after one warm-up pass."""
    for data in datas:
        call(data)
    sync(device)
    times = []
    for data in datas:
        t0 = time.perf_counter()
        call(data)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def images_per_s(backend, datas, threads: int) -> float:
    """`preprocess` of every image from `threads` threads at once; preprocess returns finished tensors."""
    run = lambda data: backend.preprocess(data, torch.bfloat16)  # noqa: E731
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, datas))  # warm-up: each thread's stream, the decoder
        t0 = time.perf_counter()
        list(pool.map(run, datas))
        return len(datas) / (time.perf_counter() - t0)


def steps_ms(cfg, datas, device) -> tuple[dict[str, float], list[str]]:
    """The default backend's preprocess step by step: each step's median ms over `datas` (each step timed on
    its own, from the previous one's outputs), and failures of the steps to make the backend's pixel values.
    Two ways to the device: the usual one (Pillow's own storage, the array copy, a pageable upload), which
    every image but an upright RGB JPEG takes, and the JPEGs' (Pillow's decoder into pinned RGBX memory of
    ours, preprocessing/jpeg_into.py; pageable off CUDA)."""
    n, dtype, pinned = range(len(datas)), torch.bfloat16, device.type == "cuda"
    rgbs = [decode_rgb(data, LIMITS)[1] for data in datas]
    arrays = [torch.from_numpy(np.array(rgb)) for rgb in rgbs]
    chws = [a.to(device).permute(2, 0, 1).contiguous() for a in arrays]
    plans = [plan(probe(data, LIMITS), cfg) for data in datas]
    rgbxs = [torch.empty((a.shape[0], a.shape[1], 4), dtype=torch.uint8, pin_memory=pinned) for a in arrays]

    def pixel_values(i: int) -> torch.Tensor:
        return torch_ops.to_pixel_values(chws[i], plans[i].resized_height, plans[i].resized_width, cfg, dtype)

    def decode_into(i: int) -> None:
        _, image = open_image(datas[i], LIMITS)
        if not (jpeg_into.takes(image, 1) and jpeg_into.decode_into(image, datas[i], rgbxs[i].numpy())):
            raise RuntimeError(f"image {i}: the direct JPEG decode did not take it")

    times = {"Pillow decode": median_ms(lambda i: decode_rgb(datas[i], LIMITS), n, device),
             "array copy": median_ms(lambda i: torch.from_numpy(np.array(rgbs[i])), n, device),
             "upload": median_ms(lambda i: arrays[i].to(device).permute(2, 0, 1).contiguous(), n, device),
             "pixel values": median_ms(pixel_values, n, device),
             "Pillow decode into pinned": median_ms(decode_into, n, device),
             "upload from pinned": median_ms(
                 lambda i: rgbxs[i].to(device, non_blocking=True)[..., :3].permute(2, 0, 1).contiguous(), n, device)}
    backend = make_backend("torchvision", cfg, LIMITS, device)
    failures = [f"image {i}: the steps' pixel values differ from the torchvision backend's" for i in n
                if not torch.equal(pixel_values(i), backend.preprocess(datas[i], dtype).pixel_values)]
    failures += [f"image {i}: the direct decode's pixels differ from Pillow's" for i in n
                 if not torch.equal(rgbxs[i][..., :3], arrays[i])]
    return times, failures


def nvjpeg_vs_pillow(decoder: NvJpegDecoder, datas) -> tuple[list[str], float, int]:
    """(failures, mean |diff|, max |diff|) of nvJPEG's pixels against Pillow's, in levels."""
    failures, means, peak = [], [], 0
    for i, data in enumerate(datas):
        header = probe(data, LIMITS)
        gpu = decoder.decode(data, header) if decoder.accepts(header) else None
        if gpu is None:
            failures.append(f"image {i} {header.width}x{header.height}: nvJPEG did not decode it (Pillow would)")
            continue
        pil = torch.from_numpy(np.array(decode_rgb(data, LIMITS)[1])).permute(2, 0, 1)
        diff = (gpu.cpu().int() - pil.int()).abs()
        means.append(diff.float().mean().item())
        peak = max(peak, int(diff.max()))
    return failures, statistics.fmean(means) if means else float("nan"), peak


def against_transformers(cfg, processor, datas, device) -> list[str]:
    """Failures of both torchvision backends against transformers' processor on `device`, bit for bit."""
    failures = []
    exact = make_backend("torchvision", cfg, LIMITS, device)
    nvjpeg = make_backend("torchvision-nvjpeg", cfg, LIMITS, device)
    for i, data in enumerate(datas):
        theirs = processor(Image.open(io.BytesIO(data)), return_tensors="pt", device=device.type)["pixel_values"]
        if not torch.equal(exact.preprocess(data).pixel_values, theirs):
            failures.append(f"image {i}: torchvision differs from transformers given the PIL image")
        _, pixels = nvjpeg.decode(data)
        theirs = processor(pixels, input_data_format="channels_first", return_tensors="pt",
                           device=device.type)["pixel_values"]
        if not torch.equal(nvjpeg.preprocess(data).pixel_values, theirs):
            failures.append(f"image {i}: torchvision-nvjpeg differs from transformers given nvJPEG's pixels")
    return failures


def markdown(setup: dict, rows: list[dict], steps: dict, decodes: dict, checks: list[str]) -> str:
    lines = ["# Preprocessing per image: Pillow vs nvJPEG decode", "", ", ".join(f"{k}: {v}" for k, v in setup.items()),
             "", f"| backend | size | decode ms (median) | preprocess ms (median) | images/s, {POOL_THREADS} threads |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['backend']} | {r['size']} | {r['decode_ms']:.2f} | {r['preprocess_ms']:.2f} "
              f"| {r['images_per_s']:.1f} |" for r in rows]
    lines += ["", "`torchvision`'s preprocess step by step, median ms:", "", "| step | " + " | ".join(steps) + " |",
              "|---" * (len(steps) + 1) + "|"]
    lines += [f"| {step} | " + " | ".join(f"{steps[size][step]:.2f}" for size in steps) + " |" for step in STEPS]
    lines += ["", "nvJPEG vs Pillow pixels: " + ("; ".join(
        f"{size} mean |diff| {d['mean']:.3f}, max {d['max']} levels" for size, d in decodes.items()) or "not run"),
        "", "Checks: " + ("all passed" if not checks else "; ".join(checks))]
    return "\n".join(lines) + "\n"


def reference(tmp: Path):
    """(our PreprocessConfig, transformers' `Qwen2VLImageProcessor` or None, why None) for Qwen2.5-VL's published
    processor settings, both read from one preprocessor_config.json."""
    spec, settings = HUB_CONFIGS["qwen2_5"]
    if importlib.util.find_spec("torchvision") is None:  # transformers would hand back its PIL processor
        cfg = PreprocessConfig.from_checkpoint(write_checkpoint(tmp, settings), spec)
        return cfg, None, "torchvision not installed: transformers' torchvision processor unavailable"
    from transformers import Qwen2VLImageProcessor

    return (*config_and_processor(tmp, spec, settings, Qwen2VLImageProcessor), "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU smoke test (no nvJPEG), few images")
    args = parser.parse_args()
    device, _ = bench_device(args.small, parser)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # the decoder and the streams need the index
    count = IMAGES["small" if args.small else "gpu"]
    datas = {size: [jpeg(w, h, seed=k) for k in range(count)] for size, (w, h) in SIZES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        cfg, processor, no_processor = reference(Path(tmp))
    checks, decodes, rows, steps = [], {}, [], {}

    decoder = NvJpegDecoder.load(device) if device.type == "cuda" else None
    if device.type == "cuda" and decoder is None:
        checks.append("nvJPEG unavailable (torchvision not importable): torchvision-nvjpeg would decode with Pillow")
    for size, images in datas.items():
        if decoder is not None:
            failures, mean, peak = nvjpeg_vs_pillow(decoder, images)
            checks += [f"{size} {f}" for f in failures]
            decodes[size] = dict(mean=mean, max=peak)
        if processor is not None:
            checks += [f"{size} {f}" for f in against_transformers(cfg, processor, images[:CHECKED], device)]
        steps[size], failures = steps_ms(cfg, images, device)
        checks += [f"{size} {f}" for f in failures]
    for name in BACKENDS:
        backend = make_backend(name, cfg, LIMITS, device)
        # pil decodes on the CPU only (decode_rgb: what its pipeline starts with)
        decode = (lambda data: decode_rgb(data, LIMITS)) if name == "pil" else backend.decode
        for size, images in datas.items():
            rows.append(dict(backend=name, fingerprint=backend.fingerprint, size=size,
                             decode_ms=median_ms(decode, images, device),
                             preprocess_ms=median_ms(lambda data: backend.preprocess(data, torch.bfloat16), images,
                                                     device),
                             images_per_s=images_per_s(backend, images, POOL_THREADS)))
            print(f"{name:20} {size:6} decode {rows[-1]['decode_ms']:7.2f} ms  preprocess "
                  f"{rows[-1]['preprocess_ms']:7.2f} ms  {rows[-1]['images_per_s']:7.1f} images/s", flush=True)

    setup = {k: v for k, v in setup_info(device, torch.bfloat16, args.small).items() if k != "sizes"} | dict(
        cpu_count=os.cpu_count(), images_per_size=count, jpeg_quality=92,
        transformers_check=f"{CHECKED} images per size" if processor is not None else f"skipped: {no_processor}")
    report = markdown(setup, rows, steps, decodes, checks)
    print(report)
    write_result("preprocess_decode", setup, dict(rows=rows, steps=steps, nvjpeg_vs_pillow=decodes, checks=checks),
                 report)
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
