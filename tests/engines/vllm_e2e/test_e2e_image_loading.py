"""vLLM's own image loader (`ImageMediaIO.load_bytes`: `normalize_image`'s EXIF orientation, then transparency
pasted onto white) hands its processor exactly the pixels our decoding does (preprocessing/decode.py), for every
image the main suite's parity tests use (tests/support/preprocess_cases.py: CASES, with the photos, every mode
and format, and every EXIF orientation in every form Pillow reads one from). Our side runs in the main venv:
this tier's has no PyAV, which the preprocessing package imports. No server is started."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from tests.support.engine_tier import require

require("vllm.multimodal.media.image", "scripts/tiers/vllm-e2e.sh")

from tests.support.encoder_process import ROOT, main_python  # noqa: E402

# The main venv writes each case's bytes and our decoded pixels ([H, W, 3] uint8) into one .npz.
OURS = """
import sys
import numpy as np
from encoder_service.preprocessing.decode import decode_rgb
from tests.support.preprocess_cases import CASES, LIMITS
out = {}
for name, make in CASES.items():
    data = make()
    out[name + "/bytes"] = np.frombuffer(data, np.uint8)
    out[name + "/rgb"] = np.asarray(decode_rgb(data, LIMITS)[1])
np.savez(sys.argv[1], **out)
"""


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict[str, tuple[bytes, np.ndarray]]:
    path = tmp_path_factory.mktemp("decoded") / "ours.npz"
    subprocess.run([main_python(), "-c", OURS, str(path)], check=True, timeout=300, cwd=ROOT)
    with np.load(path) as saved:
        names = sorted({key.rsplit("/", 1)[0] for key in saved.files})
        return {name: (saved[name + "/bytes"].tobytes(), saved[name + "/rgb"]) for name in names}


def test_vllm_loads_every_case_as_we_decode_it(ours):
    from vllm.multimodal.media.image import ImageMediaIO

    assert {"exif_jpeg_orientation_6", "exif_png_after_pixels", "exif_tiff_tag", "rgba_png"} <= set(ours)
    loader = ImageMediaIO()  # what vLLM's chat front end uses for an image_url: RGB, white behind transparency
    differ = []
    for name, (data, rgb) in ours.items():
        theirs = loader.load_bytes(data).media
        assert theirs.mode == "RGB", (name, theirs.mode)  # what the processor gets: no further conversion
        if not np.array_equal(np.asarray(theirs), rgb):
            differ.append(f"{name}: vLLM {theirs.size}, ours {rgb.shape[1]}x{rgb.shape[0]}")
    assert not differ, differ
