"""Packing images into patch-token buckets (runtime/packing.py): pure python, no model."""

import random

import pytest

from encoder_service.runtime.packing import PackedBatch, pack

BUCKETS = [1024, 2048, 4096, 8192]


def _check_plan(plan, patches, buckets, segments=None, max_segments=None):
    segments = segments or [1] * len(patches)
    seen = sorted(i for pb in plan for i in pb.indices)
    assert seen == list(range(len(patches))), "every image exactly once"
    for pb in plan:
        assert list(pb.indices) == sorted(pb.indices), "input order kept inside a batch"
        assert pb.patches == sum(patches[i] for i in pb.indices)
        assert pb.segments == sum(segments[i] for i in pb.indices)
        if pb.bucket is None:
            assert len(pb.indices) == 1
            assert pb.patches > max(buckets) or (max_segments is not None and pb.segments > max_segments)
        else:
            assert pb.patches <= pb.bucket
            smaller = [b for b in buckets if b < pb.bucket]
            assert all(b < pb.patches for b in smaller), "smallest bucket that fits"
            if max_segments is not None:
                assert pb.segments <= max_segments
    firsts = [pb.indices[0] for pb in plan]
    assert firsts == sorted(firsts)


def test_single_image_picks_smallest_bucket():
    assert pack([1024], BUCKETS) == [PackedBatch((0,), 1024, 1, 1024)]
    assert pack([1025], BUCKETS) == [PackedBatch((0,), 1025, 1, 2048)]
    assert pack([16], BUCKETS) == [PackedBatch((0,), 16, 1, 1024)]


def test_many_equal_images_fill_the_largest_bucket():
    plan = pack([1024] * 8, BUCKETS)
    assert plan == [PackedBatch(tuple(range(8)), 8192, 8, 8192)]
    plan = pack([1024] * 9, BUCKETS)
    assert [pb.bucket for pb in plan] == [8192, 1024]
    _check_plan(plan, [1024] * 9, BUCKETS)


def test_oversize_image_runs_eagerly_alone_others_still_packed():
    patches = [500, 9000, 700, 20000, 300]
    plan = pack(patches, BUCKETS)
    _check_plan(plan, patches, BUCKETS)
    eager = [pb for pb in plan if pb.bucket is None]
    assert sorted(pb.indices for pb in eager) == [(1,), (3,)]
    packed = [pb for pb in plan if pb.bucket is not None]
    assert packed == [PackedBatch((0, 2, 4), 1500, 3, 2048)]


def test_segment_slots_limit_a_bin():
    patches = [16] * 40  # tiny images: 40 segments, 640 patches
    plan = pack(patches, BUCKETS, max_segments=32)
    _check_plan(plan, patches, BUCKETS, max_segments=32)
    # a graph holds 32 images: the 40 tiny images need two bins
    assert [(len(pb.indices), pb.bucket) for pb in plan] == [(32, 1024), (8, 1024)]
    # a video of more frames than that runs eagerly; the others still pack
    plan = pack([64, 16, 16], BUCKETS, segments=[40, 1, 1], max_segments=32)
    assert plan == [PackedBatch((0,), 64, 40, None), PackedBatch((1, 2), 32, 2, 1024)]


def test_video_segments_count():
    patches, segments = [2048, 1024], [4, 1]
    plan = pack(patches, BUCKETS, segments=segments)
    assert plan == [PackedBatch((0, 1), 3072, 5, 4096)]


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_are_valid(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    patches = [rng.choice([16, 64, 256, 1024, 1496, 3600, 4784, 9000]) * rng.choice([1, 1, 2]) for _ in range(n)]
    max_segments = rng.choice([2, 8, 32]) if seed % 2 else None
    plan = pack(patches, BUCKETS, max_segments=max_segments)
    _check_plan(plan, patches, BUCKETS, max_segments=max_segments)


def test_bad_input():
    with pytest.raises(ValueError):
        pack([0], BUCKETS)
    with pytest.raises(ValueError):
        pack([10, 10], BUCKETS, segments=[1])
    assert pack([5, 6], []) == [PackedBatch((0,), 5, 1, None), PackedBatch((1,), 6, 1, None)]
