"""The graph runner (runtime/graphs.py): padding, segment boundaries, order, spill, copy-out.

CPU (CI): `GraphRunner(capture=False)` does everything but capture/replay (static buffers, padding, copy-in of every
buffer, the tower run on the static buffers, copy-out), for every tiny family, in float64; each image's output must
equal the tower run on that image alone, unpadded, to 1e-12 of its scale (GEMMs of other shapes may round
differently by an ulp or so; a boundary or padding error shows at 1e-2 and above). The batches include the SGLang
stale-boundary case (equal patch totals, different image sizes, replayed one after another on the same graph) and a
batch for each graph of every bucket the service captures.

tests/gpu/test_graphs_cuda.py runs the same batches (tests/support/graph_cases.py) through captured graphs.
"""

from __future__ import annotations

import pytest
import torch

from encoder_service.runtime.eager import EagerRunner
from encoder_service.runtime.graphs import GraphRunner
from encoder_service.runtime.runner import exact_resolution_buckets, make_runner
from encoder_service.settings import DEFAULT_BUCKETS
from encoder_service.testing.tiny import TINY_FAMILIES
from tests.support.graph_cases import (
    BUCKETS,
    MIXED,
    SAME_TOTAL_MULTI,
    SAME_TOTAL_SINGLE,
    SERVICE_BUCKETS,
    bucket_batches,
    check_batch,
    narrow_tower,
    pixels,
)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_static_buffers_equal_unpadded_eager(loaded, family):
    lm = loaded(family)
    runner = GraphRunner(lm, buckets=BUCKETS, capture=False, max_images=12)
    assert runner.describe()["runner"] == "static_buffers"
    seed = 0
    # Many replays in a row on the same graphs, alternating sizes with equal totals.
    for _ in range(2):
        for grids in SAME_TOTAL_SINGLE + SAME_TOTAL_MULTI + MIXED:
            seed += 1
            check_batch(runner, lm, grids, seed)


@pytest.fixture(scope="module")
def service_graphs():
    """The graphs the service captures (settings' ladder + the exact buckets), for the narrow tower."""
    lm = narrow_tower("cpu", torch.float64)
    exact = exact_resolution_buckets(lm.spec, max(DEFAULT_BUCKETS))
    # eager_min_patches=None: every batch that fits replays its graph (the service runs a large batch that
    # pads by more than 5% eagerly; here the padding is the point).
    runner = GraphRunner(lm, buckets=DEFAULT_BUCKETS, capture=False, exact_buckets=exact, eager_min_patches=None)
    assert runner.buckets == SERVICE_BUCKETS
    return lm, runner


@pytest.fixture
def one_thread():
    """Thousands of window-sized attention calls cost ~5x more CPU time in torch's thread pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("bucket", SERVICE_BUCKETS)
def test_every_service_bucket_equals_eager(service_graphs, one_thread, bucket):
    """Padded into each graph of the bucket (exact or single, and multi), every image equals the tower run
    on it alone."""
    lm, runner = service_graphs
    for seed, (grids, kind) in enumerate(bucket_batches(bucket, runner.exact_buckets)):
        assert [(g.bucket, g.kind) for _, g in runner.plan(grids)] == [(bucket, kind)]
        # It fits the graph (a batch that does not runs eagerly, which the outputs alone would not show),
        # in the graph's buffer shapes, every segment and window within the bounds the kernels are given.
        graph = runner.graphs[(bucket, kind)]
        padded = graph.pad(lm.tower.metadata(grids))
        assert {k: v.shape for k, v in padded.tensors().items()} == {k: v.shape for k, v in graph.static.items()}
        assert int(padded.cu_seqlens.diff().max()) <= padded.max_seqlen == graph.meta.max_seqlen
        assert int(padded.cu_window_seqlens.diff().max()) <= padded.max_window_seqlen == graph.meta.max_window_seqlen
        check_batch(runner, lm, grids, seed)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_exact_buckets(loaded, family):
    """An image of exactly an exact bucket's size replays that bucket's unpadded one-segment graph; a
    smaller single image that lands in the same bucket goes to its multi graph (padded)."""
    lm = loaded(family)
    runner = GraphRunner(lm, buckets=BUCKETS, capture=False, exact_buckets=[96, 64])
    assert runner.buckets == [64, 96, 128, 256]
    kinds = lambda grids: [g.kind for _, g in runner.plan(grids)]  # noqa: E731
    assert kinds([(1, 8, 12)]) == ["exact"] and kinds([(1, 8, 8)]) == ["exact"]
    assert kinds([(1, 10, 8)]) == ["multi"]  # 80 patches in bucket 96
    assert kinds([(1, 10, 12)]) == ["single"]  # 120 in 128
    assert runner.graphs[(96, "exact")].pad(lm.tower.metadata([(1, 8, 12)])).cu_seqlens.tolist() == [0, 96]
    seed = 50
    for grids in [[(1, 8, 12)], [(1, 12, 8)], [(1, 10, 8)], [(1, 8, 8)], [(1, 4, 16)], [(1, 8, 12), (1, 4, 4)]] * 2:
        seed += 1
        check_batch(runner, lm, grids, seed)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_solo_images_take_their_exact_graphs(loaded, family):
    """Images with an exact graph and at least solo_min_patches run alone on it, whatever they were batched
    with; the rest are packed as before; every output lands at its input position."""
    lm = loaded(family)
    runner = GraphRunner(lm, buckets=BUCKETS, capture=False, exact_buckets=[96, 64], solo_min_patches=64)
    grids = [(1, 8, 12), (1, 4, 4), (1, 8, 8), (1, 2, 2), (1, 12, 8), (2, 4, 8)]
    routes = [(b.indices, g.bucket, g.kind) for b, g in runner.plan(grids)]
    assert routes == [((0,), 96, "exact"), ((1, 3, 5), 96, "multi"), ((2,), 64, "exact"), ((4,), 96, "exact")]
    check_batch(runner, lm, grids, 70)
    # Below solo_min_patches (the default, 4096, at these sizes) the same batch packs.
    packed = GraphRunner(lm, buckets=BUCKETS, capture=False, exact_buckets=[96, 64])
    assert all(g.kind != "exact" for _, g in packed.plan(grids))


def test_measured_solo_buckets_follow_their_timings(loaded):
    """A runner that measures (captured ones always; here measure_solo on the static buffers) times each
    exact bucket's images alone against packed, runs alone exactly the buckets where that was no slower, and
    ignores solo_min_patches for the buckets it timed."""
    lm = loaded("qwen3_vl")
    runner = GraphRunner(lm, buckets=BUCKETS, capture=False, exact_buckets=[96, 64], solo_min_patches=1 << 20,
                         measure_solo=True)
    timings = runner.describe()["solo_timings"]
    assert sorted(timings) == [64, 96]
    for b, t in timings.items():
        assert t["images"] == min(runner.max_images, max(BUCKETS) // b) >= 2
        assert t["packed_bucket"] == min(x for x in runner.buckets if x >= t["images"] * b)
        assert t["packed_route"] in ("multi", "eager")
        assert t["alone_ms"] > 0 and t["packed_ms"] > 0
        assert t["solo"] == (t["images"] * t["alone_ms"] <= t["packed_ms"]) == (b in runner.solo_buckets)
    grids = [(1, 8, 12), (1, 8, 8), (1, 4, 4)]
    exact = {g.bucket for b, g in runner.plan(grids) if g.kind == "exact"}
    assert exact == set(runner.solo_buckets)
    check_batch(runner, lm, grids, 71)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_outputs_are_owned(loaded, family):
    """Outputs never alias the static buffers: a later batch must not change an earlier answer."""
    lm = loaded(family)
    runner = GraphRunner(lm, buckets=BUCKETS, capture=False)
    first = runner.encode(pixels([(1, 8, 8)], lm.spec.patch_dim, 1), [(1, 8, 8)])[0]
    kept = first.clone()
    runner.encode(pixels([(1, 4, 16)], lm.spec.patch_dim, 2), [(1, 4, 16)])
    assert torch.equal(first, kept)


def test_padding_rows_stay_finite(loaded):
    lm = loaded("qwen2_5_vl")
    runner = GraphRunner(lm, buckets=[256], capture=False)
    graph = runner.graphs[(256, "multi")]
    grids = [(1, 4, 4), (1, 6, 8)]
    out = graph.run(pixels(grids, lm.spec.patch_dim, 3), graph.pad(lm.tower.metadata(grids)))
    assert out.shape[0] == 256 // 4 and torch.isfinite(out).all()


def test_make_runner_eager_on_cpu(loaded):
    lm = loaded("qwen2_vl")
    runner = make_runner(lm, cuda_graphs=True, buckets=BUCKETS)
    assert isinstance(runner, EagerRunner) and runner.describe()["runner"] == "eager"
    check_batch(runner, lm, MIXED[0], 7)
    # max_batch_patches splits a batch into several tower calls; results unchanged.
    split = EagerRunner(lm, max_batch_patches=100)
    check_batch(split, lm, MIXED[0], 7)
    assert runner.encode([], []) == []
    with pytest.raises(ValueError):
        runner.encode(pixels([(1, 4, 4)], lm.spec.patch_dim, 0), [(1, 4, 8)])
