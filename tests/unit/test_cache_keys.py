"""Cache keys: content hashes, caller ids in their own namespace, model fingerprints."""

from __future__ import annotations

import pytest

from encoder_service.cache.keys import (
    HASH_ALGOS,
    caller_key,
    content_hash,
    key_from_id,
    make_key,
    model_fingerprint,
)
from encoder_service.errors import InvalidInput

PRE = dict(min_pixels=3136, max_pixels=12845056, image_mean=[0.48, 0.45, 0.40], image_std=[0.26, 0.26, 0.27],
           patch_size=14, merge_size=2, temporal_patch_size=2)  # fmt: skip
FP = model_fingerprint("ckpt-abc", "qwen2_5_vl", "bfloat16", PRE)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_content_key_is_hex_and_deterministic(algo):
    a, b = make_key(b"image bytes", FP, algo), make_key(b"image bytes", FP, algo)
    assert a == b and len(a.id) == 32 and int(a.id, 16) >= 0
    assert make_key(b"image bytez", FP, algo).id != a.id
    # The id is the name's one Redis Cluster hash tag: every name of the id hashes to one slot
    assert a.name == f"encsvc:{FP}:{{c:{algo}:{a.id}}}" and a.name.count("{") == a.name.count("}") == 1
    assert key_from_id(a.id, FP, algo) == a


def test_algorithms_differ_and_unknown_is_rejected():
    ids = {content_hash(b"x", algo) for algo in HASH_ALGOS}
    assert len(ids) == 3
    with pytest.raises(InvalidInput, match="md5"):
        content_hash(b"x", "md5")


def test_caller_ids_cannot_collide_with_content_ids():
    content = make_key(b"data", FP)
    caller = caller_key(content.id, FP)  # a caller choosing a string equal to a content hash
    assert caller.id == "u:" + content.id and caller.name != content.name
    assert key_from_id(caller.id, FP) == caller


@pytest.mark.parametrize("bad", ["", "has space", "tag{x}", "x" * 129, "tab\t", "é"])
def test_bad_caller_ids_are_rejected(bad):
    with pytest.raises(InvalidInput):
        caller_key(bad, FP)


@pytest.mark.parametrize("bad", ["xyz", "ABCDEF" * 6, "u:{x}", "0" * 31])
def test_malformed_ids_are_invalid_input(bad):
    with pytest.raises(InvalidInput, match="malformed id"):
        key_from_id(bad, FP)


def test_fingerprint_covers_everything_the_embedding_depends_on():
    base = dict(checkpoint_fp="ckpt-abc", family="qwen2_5_vl", dtype="bfloat16", preprocess=PRE)
    variants = [
        dict(base, checkpoint_fp="ckpt-abd"),
        dict(base, family="qwen2_vl"),
        dict(base, dtype="float32"),
        dict(base, preprocess=dict(PRE, max_pixels=1003520)),
        dict(base, preprocess=dict(PRE, image_mean=[0.5, 0.5, 0.5])),
        dict(base, preprocess=dict(PRE, merge_size=1)),
    ]
    fps = {model_fingerprint(**v) for v in variants} | {model_fingerprint(**base, numerics_version=99)}
    assert FP not in fps and len(fps) == len(variants) + 1
    # Order of settings does not matter; torch dtypes and their names agree.
    import torch

    reordered = dict(reversed(list(PRE.items())))
    assert model_fingerprint("ckpt-abc", "qwen2_5_vl", torch.bfloat16, reordered) == FP
