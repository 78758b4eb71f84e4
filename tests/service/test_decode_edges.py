"""What decoding may cost, against a real server (uvicorn on loopback) at the default pixel limit: one image's
pixels (--max-pixels, checked from its header), a request's together (--max-request-pixels), the CPU threads
shared fairly between requests (one request of many large images does not hold another client's small one
back until all of them are prepared), and a PNG Pillow refuses to open saying Pillow's reason."""

from __future__ import annotations

import io

import httpx
import pytest
from PIL import Image, PngImagePlugin

from encoder_service.api.service import bind_socket
from encoder_service.settings import MAX_PIXELS, Settings
from tests.support.images import image_bytes, png_header_only, png_with_text
from tests.support.service import RunningService

pytestmark = pytest.mark.timeout(120)
BIG_IMAGES = 16  # one request's large images
BIG_SIDE = 1500  # each 1500x1500 (2.25 Mpx): ~0.1 s of a CPU thread to decode and resize
REQUEST_PIXELS = 40_000_000  # --max-request-pixels here: the 16 large images (36 Mpx) fit


@pytest.fixture(scope="module")
def svc(tiny_checkpoint) -> RunningService:
    """The defaults but for the number of images and --max-request-pixels (no TEST_LIMITS: --max-pixels is the
    default)."""
    args = ["--model", str(tiny_checkpoint("qwen2_5_vl")), "--host", "127.0.0.1", "--device", "cpu", "--log-level",
            "warning", "--grpc-port", "0", "--max-images", "32", "--max-request-pixels", str(REQUEST_PIXELS)]
    service = RunningService(Settings.from_args(args, env={}), http_sock=bind_socket("127.0.0.1", 0))
    yield service
    service.close()


def encode(url: str, files: list[bytes], **query) -> httpx.Response:
    return httpx.post(f"{url}/v1/encode", params=query, files=[("image", (f"i{k}.png", data, "image/png"))
                                                               for k, data in enumerate(files)], timeout=60)


def test_the_default_pixel_limit_refuses_an_8000x8000_png(svc):
    """64 Mpx (the old default's 67108864 let it through, 0.66 s of CPU each); an 8K UHD frame still passes."""
    assert svc.settings.limits.max_pixels == MAX_PIXELS == 33_554_432
    r = encode(svc.url, [png_header_only(8000, 8000)])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["kind"] == "limit" and "33554432" in r.json()["error"]["message"]
    assert encode(svc.url, [png_header_only(7680, 4320)]).status_code == 200  # answered from the header


def test_a_request_s_decoded_pixels_are_bounded_together(svc):
    """Each image passes --max-pixels; together they are over --max-request-pixels: 400 naming the flag, before
    any is decoded (header-only PNGs: their pixel data would not decode)."""
    images = [png_with_text(png_header_only(2000, 2000), n) for n in range(11)]  # 44 Mpx
    r = encode(svc.url, images)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["kind"] == "limit" and "--max-request-pixels" in error["message"]
    assert "44000000" in error["message"] and str(REQUEST_PIXELS) in error["message"]
    assert encode(svc.url, images[:10]).status_code == 200  # 40 Mpx: at the limit


def solid_png(side: int) -> bytes:
    """A large PNG of one colour: a few KB to send, ~side^2 pixels to decode."""
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 30, 200)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_small_image_is_not_held_back_by_another_request_s_large_ones(svc):
    """A request of 16 large images (answered from their headers), then another client's small image with
    wait=true: the CPU threads take from the two requests in turn, so the small one's rows are there before
    the large ones are all prepared (first come, first served per image, it came after all 16). The order is
    read through the API: when the small image's answer arrives, a fetch that does not wait (timeout_s=0)
    finds the last large image (a request's images are prepared in their order) not encoded yet."""
    big = [png_with_text(solid_png(BIG_SIDE), n) for n in range(BIG_IMAGES)]
    with httpx.Client(base_url=svc.url, timeout=60) as first, httpx.Client(base_url=svc.url, timeout=60) as other:
        r = first.post("/v1/encode", files=[("image", (f"b{k}.png", data, "image/png")) for k, data in enumerate(big)])
        assert r.status_code == 200, r.text
        last = r.json()["images"][-1]
        small = other.post("/v1/encode", params={"wait": "true", "timeout_s": "60"},
                           content=image_bytes(56, 56, seed=381), headers={"content-type": "image/png"})
        assert small.status_code == 200, small.text
        fetch = first.post("/v1/fetch", json={"items": [{"id": last["id"], "offset": 0}], "start": 0,
                                              "end": last["num_tokens"], "timeout_s": 0})
        assert fetch.status_code == 504, f"the last large image was encoded before the small one ({fetch.status_code})"
        done = first.post("/v1/encode", params={"wait": "true", "timeout_s": "60"},  # they all land after it
                          files=[("image", (f"b{k}.png", data, "image/png")) for k, data in enumerate(big)])
        assert done.status_code == 200 and all(i["cached"] for i in done.json()["images"]), done.text


def test_a_png_over_pillow_s_text_chunk_limit_says_pillow_s_reason(svc):
    buf = io.BytesIO()
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "x" * (PngImagePlugin.MAX_TEXT_CHUNK + 1), zip=True)  # 1 KB of zTXt, 1 MB unpacked
    Image.new("RGB", (32, 32)).save(buf, format="PNG", pnginfo=info)
    r = encode(svc.url, [buf.getvalue()])
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("image 0: ") and "MAX_TEXT_CHUNK" in message, message
