"""load_model: errors that name the problem, reading only vision tensors, single-file and hub checkpoints,
dtypes, fingerprints, the exact MLP padding."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import RemoteEntryNotFoundError
from safetensors import safe_open
from safetensors.torch import save_file

from encoder_service.errors import ModelLoadError
from encoder_service.models import loader
from encoder_service.models.checkpoint_layout import checkpoint_layout
from encoder_service.models.loader import load_model
from encoder_service.testing.tiny import TINY_FAMILIES


def all_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            tensors |= {key: f.get_tensor(key) for key in f.keys()}
    return tensors


def single_file_copy(src: Path, dst: Path, edit=lambda tensors: None) -> Path:
    """`src` rewritten as one model.safetensors (no index), after `edit(tensors)` changed the tensors."""
    dst.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(src / name, dst / name)
    tensors = all_tensors(src)
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.fixture
def qwen25(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2_5_vl")


def test_missing_key(qwen25, tmp_path):
    path = single_file_copy(qwen25, tmp_path / "ckpt", lambda t: t.pop("visual.blocks.0.attn.qkv.bias"))
    with pytest.raises(ModelLoadError, match=r"missing \(1\): blocks\.0\.attn\.qkv\.bias"):
        load_model(path, device="cpu")


def test_wrong_shape(qwen25, tmp_path):
    def shrink(tensors):
        tensors["visual.blocks.1.mlp.down_proj.weight"] = torch.zeros(32, 39)

    path = single_file_copy(qwen25, tmp_path / "ckpt", shrink)
    with pytest.raises(ModelLoadError) as err:
        load_model(path, device="cpu")
    assert "mis-shaped (1): blocks.1.mlp.down_proj.weight (32, 39) (expected (32, 40))" in err.value.message


def test_unexpected_and_missing_listed_together(qwen25, tmp_path):
    def edit(tensors):
        tensors["visual.blocks.4.attn.qkv.weight"] = torch.zeros(96, 32)
        del tensors["visual.merger.ln_q.weight"]

    path = single_file_copy(qwen25, tmp_path / "ckpt", edit)
    with pytest.raises(ModelLoadError) as err:
        load_model(path, device="cpu")
    assert "unexpected (1): blocks.4.attn.qkv.weight" in err.value.message
    assert "missing (1): merger.ln_q.weight" in err.value.message


def test_no_vision_weights(qwen25, tmp_path):
    def drop_vision(tensors):
        for key in [k for k in tensors if k.startswith("visual.")]:
            del tensors[key]

    path = single_file_copy(qwen25, tmp_path / "ckpt", drop_vision)
    with pytest.raises(ModelLoadError, match="holds no vision weights"):
        load_model(path, device="cpu")


def test_unsupported_architecture(qwen25, tmp_path):
    path = tmp_path / "llava"
    shutil.copytree(qwen25, path)
    config = json.loads((path / "config.json").read_text())
    config |= {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_model(path, device="cpu")
    for expected in ("unsupported model", "'llava'", "LlavaForConditionalGeneration", "qwen2_5_vl", "qwen3_vl_moe"):
        assert expected in err.value.message


def test_missing_vision_config_key(qwen25, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(qwen25, path)
    config = json.loads((path / "config.json").read_text())
    del config["vision_config"]["window_size"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="vision_config has no 'window_size'"):
        load_model(path, device="cpu")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])  # `visual.` and `model.visual.` prefixes
def test_reads_only_vision_tensors(tiny_checkpoint, family, monkeypatch):
    path = tiny_checkpoint(family)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    vision_keys = {k for k in weight_map if k.startswith(("visual.", "model.visual."))}
    lm_only_shards = set(weight_map.values()) - {weight_map[k] for k in vision_keys}
    assert lm_only_shards, "the tiny checkpoint should have shards without vision tensors"

    opened, read = [], []

    class RecordingSafeOpen:
        def __init__(self, filename, framework):
            opened.append(Path(filename).name)
            self.inner = safe_open(filename, framework=framework)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.file.get_tensor(key)

    monkeypatch.setattr(loader, "safe_open", RecordingSafeOpen)
    load_model(path, device="cpu")
    assert not set(opened) & lm_only_shards
    assert sorted(read) == sorted(vision_keys)


def test_single_file_checkpoint_equals_sharded(qwen25, tmp_path):
    sharded = load_model(qwen25, device="cpu")
    single = load_model(single_file_copy(qwen25, tmp_path / "ckpt"), device="cpu")
    assert single.fingerprint == sharded.fingerprint
    for (name, a), (_, b) in zip(sharded.tower.state_dict().items(), single.tower.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mlp_padding_is_exact(tiny_checkpoint, family, dtype):
    """The loader zero-pads the MLP width to a multiple of 128 (Qwen2.5: gate and up merged too).

    Bit for bit: every stored tensor sits unchanged in its view of the padded parameter, everything outside
    the views is zero, and so the MLP's hidden activations are exactly zero in the padded columns (act(0) = 0
    for quick_gelu, tanh GELU and SiLU-gated): the padding adds exact zeros to the down projection.
    To a few ulp, not bit for bit: the towers' outputs. The padded GEMMs have other shapes (the up projection's
    output 64 -> 128 columns, the down projection's inner size 64 -> 128), and a BLAS may take another path
    for another shape and round the same sums differently (MKL's float64 GEMM on an AMD CPU does, by an ulp,
    unless MKL_CBWR pins its path). A padding error (a stored column misplaced, a non-zero pad) shows at 1e-2
    and above."""
    plain = load_model(tiny_checkpoint(family), device="cpu", dtype=dtype, mlp_pad_multiple=1)
    padded = load_model(tiny_checkpoint(family), device="cpu", dtype=dtype)
    width = plain.tower.config.intermediate_size
    assert width % 128 and padded.tower.config.intermediate_size_padded == 128
    assert plain.tower.blocks[0].mlp.down_proj.weight.shape[1] == width
    assert padded.tower.blocks[0].mlp.down_proj.weight.shape[1] == 128
    assert padded.fingerprint == plain.fingerprint  # the checkpoint's identity, not the tower's layout

    plain_params, padding = dict(plain.tower.named_parameters()), {}
    for name, stored in checkpoint_layout(padded.tower).items():
        param = dict(padded.tower.named_parameters())[stored.param]
        as_stored = checkpoint_layout(plain.tower)[name].view(plain_params[stored.param])
        assert torch.equal(stored.view(param), as_stored), name
        stored.view(padding.setdefault(stored.param, param.detach().clone())).zero_()
    assert not any(rest.any() for rest in padding.values())  # outside the stored views: zeros only

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, plain.tower.config.hidden_size, generator=generator).to(dtype)
    with torch.no_grad():
        for narrow, wide in zip(plain.tower.blocks, padded.tower.blocks):
            hidden = wide.mlp.hidden(x)  # [40, 128]
            assert not hidden[:, width:].any()
            assert_ulp_close(hidden[:, :width], narrow.mlp.hidden(x))

    grids = [(1, 8, 12), (1, 4, 4), (2, 4, 4)]
    patches = sum(t * h * w for t, h, w in grids)
    pv = torch.randn(patches, plain.spec.patch_dim, generator=generator).to(dtype)
    with torch.no_grad():
        ref = plain.tower(pv, plain.tower.metadata(grids))
        out = padded.tower(pv, padded.tower.metadata(grids))
    assert_ulp_close(out, ref)


def assert_ulp_close(out: torch.Tensor, ref: torch.Tensor, ulps: int = 64) -> None:
    """|out - ref| within `ulps` units in the last place of ref's largest magnitude (measured here: up to
    1.4 in float64 at the tower's output, 0 in float32)."""
    bound = ulps * torch.finfo(ref.dtype).eps * ref.abs().max().item()
    diff = (out - ref).abs().max().item()
    assert diff <= bound, f"max |diff| {diff:.3g} over {ulps} ulp ({bound:.3g})"


def test_fingerprint_changes_with_weights(qwen25, tmp_path):
    def perturb(tensors):
        tensors["visual.blocks.0.norm1.weight"] = tensors["visual.blocks.0.norm1.weight"] + 1e-3

    original = load_model(single_file_copy(qwen25, tmp_path / "a"), device="cpu")
    perturbed = load_model(single_file_copy(qwen25, tmp_path / "b", perturb), device="cpu")
    assert original.fingerprint != perturbed.fingerprint


def test_dtype_default_and_override(qwen25):
    default = load_model(qwen25, device="cpu")
    assert default.dtype == torch.float32
    assert {p.dtype for p in default.tower.parameters()} == {torch.float32}
    assert loader._resolve_dtype(None, torch.device("cuda")) == torch.bfloat16

    for requested in ("bfloat16", torch.bfloat16):
        loaded = load_model(qwen25, device="cpu", dtype=requested)
        assert loaded.dtype == torch.bfloat16
        assert {p.dtype for p in loaded.tower.parameters()} == {torch.bfloat16}
        grid = [(1, 4, 4)]
        out = loaded.tower(torch.randn(16, loaded.spec.patch_dim), loaded.tower.metadata(grid))
        assert out.dtype == torch.bfloat16 and out.shape == (4, loaded.spec.row_width)

    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        load_model(qwen25, device="cpu", dtype="int8")


@pytest.mark.parametrize("layout", ["sharded", "single_file"])
def test_hub_downloads_only_what_is_needed(tiny_checkpoint, tmp_path, monkeypatch, layout):
    source = tiny_checkpoint("qwen3_vl")
    if layout == "single_file":
        source = single_file_copy(source, tmp_path / "single")
    requested = []

    def fake_download(repo_id, filename, *, revision=None, **kwargs):
        assert (repo_id, revision) == ("Qwen/Tiny-VL", "abc123")
        requested.append(filename)
        if not (source / filename).is_file():
            response = types.SimpleNamespace(headers={}, request=None)
            raise RemoteEntryNotFoundError(f"{filename} not found", response=response)
        return str(source / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    loaded = load_model("Qwen/Tiny-VL", device="cpu", revision="abc123")
    assert loaded.checkpoint_dir == source

    if layout == "sharded":
        weight_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
        vision_shards = {shard for key, shard in weight_map.items() if key.startswith("model.visual.")}
        needed = {"config.json", "preprocessor_config.json", "model.safetensors.index.json"} | vision_shards
    else:
        needed = {"config.json", "preprocessor_config.json", "model.safetensors.index.json", "model.safetensors"}
    assert set(requested) == needed
