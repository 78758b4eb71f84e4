"""Our towers vs transformers' own vision towers, from the same saved tiny checkpoint (CPU, float32), and
the batch metadata they run on (models/metadata.py: per-shape pieces, padding).

Relative error = max|ours - ref| / max|ref| (must be <= 1e-5); the mean (mean|ours - ref| / mean|ref|) is
printed too (`pytest -s`). Qwen3 compares the main rows and every deepstack level separately. An image in a
batch or padded against the same image alone is held to the same bound, not bit for bit: the GEMMs have other
row counts, which a BLAS may round differently (MKL does, with MKL_CBWR=COMPATIBLE, by a few ulp); a boundary
or padding error shows at 1e-2 and above.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import vision_utils

from encoder_service.models.loader import load_model
from encoder_service.models.metadata import EXACT, MULTI, SINGLE, PaddedShape, pad_boundaries
from encoder_service.testing.tiny import TINY_FAMILIES

MAX_REL_ERR = 1e-5

REFERENCE_CLASSES = {
    "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
}

# Patch grids (t, h, w). Qwen2.5's tiny window is 2x2 merged tokens, so merged grids of even sides are
# divisible by it (transformers then pads a whole empty window row/column) and odd sides are not.
SINGLE_GRIDS = [
    (1, 4, 4),  # one merged 2x2 block: a single window
    (1, 8, 8),  # merged 4x4: divisible by the window
    (1, 10, 6),  # merged 5x3: partial windows on both edges
    (1, 6, 16),  # wide
    (1, 18, 4),  # tall
    (2, 8, 12),  # two frames: one attention segment per frame
]
BATCH = [(1, 8, 12), (2, 4, 4), (1, 10, 6), (1, 4, 4)]


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """family -> (our LoadedModel, transformers' vision tower), loaded once."""
    cache = {}

    def get(family):
        if family not in cache:
            path = tiny_checkpoint(family)
            ours = load_model(path, device="cpu", dtype=torch.float32)
            full = REFERENCE_CLASSES[family].from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
            cache[family] = (ours, full.model.visual.eval())
        return cache[family]

    return get


def pixels(grids, patch_dim, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, patch_dim, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def run_ours(loaded, pixel_values, grids):
    return loaded.tower(pixel_values, loaded.tower.metadata(grids))


@torch.no_grad()
def run_reference(reference, pixel_values, grids):
    """[num_tokens, row_width]: the pooled output, then Qwen3's deepstack features (our row layout)."""
    out = reference(pixel_values, grid_thw=torch.tensor(grids))
    deepstack = getattr(out, "deepstack_features", None) or []
    return torch.cat([out.pooler_output, *deepstack], dim=1)


def rel_errors(ours, ref):
    diff = (ours - ref).abs()
    return (diff.max() / ref.abs().max()).item(), (diff.mean() / ref.abs().mean()).item()


def assert_parity(loaded, ours, ref, label):
    assert ours.shape == ref.shape
    width = loaded.spec.out_hidden_size
    levels = ["main"] + [f"deepstack_{k}" for k in range(1, loaded.spec.num_deepstack + 1)]
    for i, level in enumerate(levels):
        max_err, mean_err = rel_errors(ours[:, i * width : (i + 1) * width], ref[:, i * width : (i + 1) * width])
        print(f"{label} {level}: max rel err {max_err:.2e}, mean rel err {mean_err:.2e}")
        assert max_err <= MAX_REL_ERR, f"{label} {level}: max rel err {max_err:.2e}"


@pytest.mark.parametrize("grid", SINGLE_GRIDS, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_single_image_matches_transformers(models, family, grid):
    loaded, reference = models(family)
    pv = pixels([grid], loaded.spec.patch_dim)
    assert_parity(loaded, run_ours(loaded, pv, [grid]), run_reference(reference, pv, [grid]), f"{family} {grid}")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_batch_matches_transformers(models, family):
    loaded, reference = models(family)
    pv = pixels(BATCH, loaded.spec.patch_dim)
    assert_parity(loaded, run_ours(loaded, pv, BATCH), run_reference(reference, pv, BATCH), f"{family} batch")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_each_image_of_a_batch_equals_it_alone(models, family):
    loaded, _ = models(family)
    pv = pixels(BATCH, loaded.spec.patch_dim)
    batched = run_ours(loaded, pv, BATCH)
    patch_counts = [t * h * w for t, h, w in BATCH]
    token_counts = [n // loaded.spec.merge_size**2 for n in patch_counts]
    for grid, image_pv, rows in zip(BATCH, pv.split(patch_counts), batched.split(token_counts)):
        assert_parity(loaded, rows, run_ours(loaded, image_pv, [grid]), f"{family} {grid} batched vs alone")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_padded_metadata_leaves_real_rows_unchanged(models, family):
    loaded, _ = models(family)
    meta = loaded.tower.metadata(BATCH)
    pad = 6 * meta.merge_unit
    num_patches, num_segments = meta.num_patches + pad, 40
    # Bounds of num_patches: the dummy rows are one segment (one window).
    padded = meta.padded(PaddedShape(num_patches, num_segments, num_patches, num_segments, num_patches))

    # Segment tensors have fixed sizes; the dummy rows are one trailing segment, then empty slots.
    assert padded.cu_seqlens.shape == (num_segments + 1,)
    assert padded.cu_seqlens[len(meta.cu_seqlens) - 1 :].tolist() == [meta.num_patches] + [num_patches] * (
        num_segments + 1 - len(meta.cu_seqlens)
    )
    if padded.window_index is not None:
        assert padded.cu_window_seqlens.shape == (num_segments + 1,)
        num_units = meta.num_patches // meta.merge_unit
        tail = list(range(num_units, num_units + pad // meta.merge_unit))
        assert padded.window_index[num_units:].tolist() == tail
        assert padded.reverse_index[num_units:].tolist() == tail

    # Large garbage in the dummy rows must not reach the real rows.
    pv = pixels(BATCH, loaded.spec.patch_dim)
    garbage = 100 * torch.randn(pad, loaded.spec.patch_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = loaded.tower(torch.cat([pv, garbage]), padded)
    real_tokens = meta.num_patches // meta.merge_unit
    assert out.shape == (real_tokens + pad // meta.merge_unit, loaded.spec.row_width)
    assert_parity(loaded, out[:real_tokens], run_ours(loaded, pv, BATCH), f"{family} padded vs not")


def test_padded_rejects_too_few_segment_slots(models):
    meta = models("qwen2_5_vl")[0].tower.metadata(BATCH)
    n = meta.num_patches + meta.merge_unit
    with pytest.raises(ValueError, match="window_slots"):
        meta.padded(PaddedShape(n, segment_slots=6, max_seqlen=n, window_slots=3, max_window_seqlen=n))
    with pytest.raises(ValueError, match="multiple of 4"):
        meta.padded(PaddedShape(n + 1, segment_slots=60, max_seqlen=n + 1, window_slots=60, max_window_seqlen=n + 1))
    with pytest.raises(ValueError, match="max_window_seqlen"):  # a window over the graph's bound
        meta.padded(PaddedShape(n, segment_slots=6, max_seqlen=n, window_slots=60, max_window_seqlen=8))


def test_pad_boundaries():
    """Dummy rows as segments of at most `limit` rows, then zero-length slots up to the fixed count."""
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    assert pad_boundaries(cu, 12, 4, 3).tolist() == [0, 5, 12, 12]
    assert pad_boundaries(cu, 30, 8, 6).tolist() == [0, 5, 12, 20, 28, 30, 30]
    assert pad_boundaries(cu, 30, 100, 3).tolist() == [0, 5, 12, 30]
    with pytest.raises(ValueError):
        pad_boundaries(cu, 30, 8, 4)


def test_graph_shapes():
    """Slots and bounds per graph kind (Qwen2.5-VL-7B: windows of 4 x 4 merged tokens)."""
    shape = lambda kind, windows=4: PaddedShape.for_graph(  # noqa: E731
        1024, kind, max_images=32, merge_unit=4, window_units=windows
    )
    # windows: 256 units at <= 1/4 window each, + 1 per frame, + 16 dummy windows of 64 rows, + 1
    assert shape(MULTI) == PaddedShape(1024, 33, 1024, 64 + 32 + 16 + 1, 64)
    assert shape(SINGLE) == PaddedShape(1024, 2, 1024, 113, 64)
    assert shape(EXACT) == PaddedShape(1024, 1, 1024, 113, 64)
    assert shape(MULTI, windows=None) == PaddedShape(1024, 33, 1024)


def test_window_layout_matches_transformers(models):
    """Window index and boundaries, incl. the padding quirk, equal transformers' helper exactly."""
    loaded, _ = models("qwen2_5_vl")
    c = loaded.tower.config
    grids = BATCH + [(1, 8, 8), (1, 16, 4)]
    ref_index, ref_cu = vision_utils.get_vision_window_index(
        torch.tensor(grids), c.merge_size, c.window_size, c.patch_size
    )
    meta = loaded.tower.metadata(grids)
    assert meta.window_index.tolist() == ref_index.tolist()
    assert meta.cu_window_seqlens.tolist() == ref_cu.tolist()
    assert meta.reverse_index.tolist() == torch.argsort(ref_index).tolist()


def test_position_interpolation_matches_transformers(models):
    loaded, _ = models("qwen3_vl")
    c = loaded.tower.config
    grids = BATCH + [(1, 2, 30)]
    ref_indices, ref_weights = vision_utils.get_vision_interpolation_indices_and_weights(
        torch.tensor(grids), c.pos_embed_side, mode="bilinear", align_corners=True, spatial_merge_size=c.merge_size
    )
    meta = loaded.tower.metadata(grids)
    assert torch.equal(meta.pos_indices, ref_indices)
    assert torch.equal(meta.pos_weights, ref_weights)


def test_bfloat16_norm_and_rotary_round_like_transformers():
    """The casts that float32 parity cannot see: RMSNorm multiplies the weight after casting back, and the
    rotary runs in float32 before casting back. Both must be bit-equal to transformers in bfloat16."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as ref

    from encoder_service.models.layers import RMSNorm
    from encoder_service.ops.rotary import apply_rotary

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=generator).bfloat16()
    ours, theirs = RMSNorm(32), ref.Qwen2_5_VLRMSNorm(32)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(32, generator=generator))
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.bfloat16(), theirs.bfloat16()
    assert torch.equal(ours(x), theirs(x))

    q, k = (torch.randn(64, 2, 16, generator=generator).bfloat16() for _ in range(2))
    cos, sin = torch.randn(64, 16, generator=generator), torch.randn(64, 16, generator=generator)
    for a, b in zip(apply_rotary(q, k, cos, sin), ref.apply_rotary_pos_emb_vision(q, k, cos, sin)):
        assert torch.equal(a, b)


# ---- videos: a real clip's frame groups (preprocessing/video.py), t > 1 and an odd frame count ----


def video_pixels(loaded, checkpoint):
    """(pixel_values of every frame group in order, grid_thw, the plan) of a 7-frame 128x96 clip: 4 groups,
    the last one its last frame twice, as transformers pads."""
    from encoder_service.preprocessing.limits import VideoLimits
    from encoder_service.preprocessing.video import VideoOptions, plan_video, preprocess_group
    from encoder_service.preprocessing.video_config import VideoConfig
    from encoder_service.preprocessing.video_decode import iter_frame_groups, probe_video
    from tests.support.video_cases import make_clip

    cfg, limits = VideoConfig.from_checkpoint(checkpoint, loaded.spec), VideoLimits()
    data = make_clip("mp4_h264", frames=7, width=128, height=96)
    plan = plan_video(probe_video(data, limits), cfg, VideoOptions(sample_frames=False), limits)
    groups = [preprocess_group(frames, plan, cfg) for frames in iter_frame_groups(data, plan, limits)]
    assert plan.grid_thw[0] == len(groups) == 4 and plan.group_frames(3) == (6, 6)
    return groups, plan.grid_thw, plan


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_video_matches_transformers(models, tiny_checkpoint, family):
    """The whole video as one grid (t, h, w), and frame group by frame group (each (1, h, w), the way the
    service encodes videos), against transformers' tower on the whole video."""
    loaded, reference = models(family)
    groups, grid, plan = video_pixels(loaded, tiny_checkpoint(family))
    pixel_values = torch.cat(groups)
    expected = run_reference(reference, pixel_values, [grid])
    assert_parity(loaded, run_ours(loaded, pixel_values, [grid]), expected, f"{family} video {grid}")
    by_group = torch.cat([run_ours(loaded, g, [plan.group_grid]) for g in groups])
    assert_parity(loaded, by_group, expected, f"{family} video group by group")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_video_groups_through_the_runner(models, tiny_checkpoint, family):
    """Groups as the engine will submit them: items of one runner batch, each its own (1, h, w) grid."""
    from encoder_service.runtime.runner import EagerRunner

    loaded, _ = models(family)
    groups, grid, plan = video_pixels(loaded, tiny_checkpoint(family))
    rows = EagerRunner(loaded).encode(groups, [plan.group_grid] * len(groups))
    assert [r.shape[0] for r in rows] == [plan.tokens_per_group] * plan.num_groups
    assert_parity(loaded, torch.cat(rows), run_ours(loaded, torch.cat(groups), [grid]), f"{family} runner groups")
