"""Where one image's preprocessing goes (issue 40, item 1): latency_bench's "preprocess" stage split into its
steps, one image at a time on one thread, as the engine's CPU thread runs them with the default backend
(`--preprocess torchvision`: Pillow decodes, the rest on the device).

Per size (720p and 1080p photo-like JPEGs, each its own), median ms of:

  header          probe: the header read and its limits (the service's probe does it once more per request)
  decode          Pillow: open, decode, EXIF orientation, RGB (preprocessing/decode.py: decode_rgb)
  to array        np.array of the decoded image and from_numpy: the [H, W, 3] uint8 copy transformers makes too
  upload          that array to the device and its CHW copy there (pageable memory), synchronized
  pixel values    resize, rescale, normalize, patchify on the device (torch_ops.to_pixel_values), synchronized
  whole           the backend's own preprocess of the same image (what the service times), synchronized
  pil whole       the `pil` backend's preprocess (everything on the CPU), for comparison

and the Qwen2.5-VL (or --family qwen3_vl) processor settings of the published checkpoints. No model is loaded.

    python -m benchmarks.preprocess_split                  # CUDA (seconds)
    python -m benchmarks.preprocess_split --small          # CPU smoke test (benchmarks/tests/)

Writes benchmarks/results/preprocess_split-<date>-<commit>.json and $OUT/preprocess_split.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from benchmarks.common.device import bench_device, sync
from benchmarks.common.images import make_jpegs
from benchmarks.common.report import setup_info, write_result
from benchmarks.common.stats import percentile

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
SIZES = {"720p": (1280, 720), "1080p": (1920, 1080)}
STEPS = ("header", "decode", "to array", "upload", "pixel values", "whole", "pil whole")
WARMUP = 3


def split_one(data: bytes, backend, pil_backend, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """One image's steps, ms; "same" is whether the steps made the backend's own pixel values, bit for bit."""
    from encoder_service.preprocessing import decode, plan, probe, torch_ops

    times, t = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        times[name], t = (now - t) * 1e3, now

    header = probe(data, backend.limits, exif_orientation=True)
    image_plan = plan(header, backend.cfg)
    lap("header")
    _, rgb = decode.decode_rgb(data, backend.limits, exif_orientation=True)
    lap("decode")
    hwc = torch.from_numpy(np.array(rgb))
    lap("to array")
    chw = hwc.to(device).permute(2, 0, 1).contiguous()
    sync(device)
    lap("upload")
    split = torch_ops.to_pixel_values(chw, image_plan.resized_height, image_plan.resized_width, backend.cfg, dtype)
    sync(device)
    lap("pixel values")
    whole = backend.preprocess(data, dtype).pixel_values
    sync(device)
    lap("whole")
    pil_backend.preprocess(data, dtype)
    lap("pil whole")
    return times | dict(same=bool(torch.equal(split, whole)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="on the CPU, a few images")
    parser.add_argument("--family", default=FAMILIES[0], choices=FAMILIES)
    parser.add_argument("--images", type=int, help="timed images per size (default 30; --small 2)")
    args = parser.parse_args()
    count = args.images or (2 if args.small else 30)

    from encoder_service.preprocessing import ImageLimits, PreprocessConfig, make_backend
    from tests.support.preprocess_cases import QWEN2_5, QWEN3  # the families' vision specs

    device, dtype = bench_device(args.small, parser)
    cfg = PreprocessConfig.default_for(QWEN2_5 if args.family == "qwen2_5_vl" else QWEN3)
    limits = ImageLimits(max_image_bytes=64 << 20, max_pixels=1 << 25)
    backend = make_backend("torchvision", cfg, limits, device)
    pil_backend = make_backend("pil", cfg, limits, "cpu")
    setup = setup_info(device, dtype, args.small) | dict(family=args.family, images=count, backend=backend.fingerprint)
    result, checks = {}, []
    for k, (name, size) in enumerate(SIZES.items()):
        images = make_jpegs(size, range(2_000_000 * (k + 1), 2_000_000 * (k + 1) + WARMUP + count))
        rows = [split_one(data, backend, pil_backend, device, dtype) for data in images][WARMUP:]
        result[name] = dict(median_ms={s: percentile([r[s] for r in rows], 50) for s in STEPS}, images=rows)
        checks += [f"{name} image {k}: the steps' pixel values differ from the backend's" for k, r in
                   enumerate(rows) if not r["same"]]
    lines = [f"# One image's preprocessing, step by step ({args.family}, issue 40 item 1)", "",
             ", ".join(f"{k}: {v}" for k, v in setup.items()), "", "Median ms, one image at a time on one thread.",
             "", "| step | " + " | ".join(SIZES) + " |", "|---" * (len(SIZES) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(f"{result[n]['median_ms'][s]:.2f}" for n in SIZES) + " |" for s in STEPS]
    lines += ["", "Checks: " + ("all passed" if not checks else "; ".join(checks))]
    report = "\n".join(lines) + "\n"
    write_result("preprocess_split", setup, result | dict(failed_checks=checks), report)
    print(report)
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
