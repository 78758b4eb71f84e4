"""Query options against a real uvicorn server (tests/support/service.py): each endpoint takes the options of
the body sent (api/query_options.py), and anything else (a typo, a video option on an image, an option given
twice, any option beside a JSON body) is a 400 naming it instead of being ignored; `?id=` names a multipart
body's one image or video."""

from __future__ import annotations

import httpx
import pytest

from tests.support.images import image_bytes
from tests.support.video_cases import make_clip

PNG = image_bytes(64, 48, seed=3811)
CLIP = make_clip("mp4_h264", frames=4, width=64, height=48)


def post(svc, query: str, **kw) -> httpx.Response:
    return httpx.post(f"{svc.url}{query}", timeout=30, **kw)


def image_body(data: bytes = PNG) -> dict:
    return {"content": data, "headers": {"content-type": "image/png"}}


def image_parts(*images: bytes) -> dict:
    return {"files": [("image", (f"i{k}.png", data, "image/png")) for k, data in enumerate(images)]}


REFUSED = {
    "a typo": ("/v1/encode?wiat=true", image_body(), "an image body: query option 'wiat' not taken (it takes "
                                                     "wait, return_embeddings, timeout_s, id, ipc_host, ipc_ack)"),
    "fps on a binary image": ("/v1/encode?fps=2", image_body(), "'fps' only with a video"),
    "fps on multipart images": ("/v1/encode?fps=2&wait=true", image_parts(PNG), "'fps' only with a video"),
    "an empty fps on an image": ("/v1/encode?fps=", image_body(), "'fps' only with a video"),
    "id twice": ("/v1/encode?id=a&id=b", image_body(), "query option 'id' given more than once"),
    "wait beside JSON": ("/v1/encode?wait=true", {"json": {"images": []}},
                         "a JSON body (its options go in the body): query option 'wait' not taken (it takes none)"),
    "video=true on image/png": ("/v1/encode?video=true", {"content": PNG, "headers": {"content-type": "image/png"}},
                                "'video' not taken"),
    "an id for two images": ("/v1/encode?id=two", image_parts(PNG, image_bytes(32, 32, seed=3812)),
                             "'id' names one image or video, and this multipart body holds 2"),
    "an option of fetch's body": ("/v1/fetch?timeout_s=0", {"json": {"items": [], "start": 0, "end": 1}},
                                  "POST /v1/fetch (its options go in the JSON body): query option 'timeout_s'"),
    "release": ("/v1/release?ids=x", {"json": {"ids": []}}, "query option 'ids' not taken"),
    # its tokens were dropped, unacknowledged, without a word
    "ipc_ack without ipc_host": ("/v1/encode?ipc_ack=t1", image_body(), "query option 'ipc_ack' without ipc_host"),
    "ipc_ack on a video body": ("/v1/encode?ipc_ack=t1", {"content": CLIP, "headers": {"content-type": "video/mp4"}},
                                "query option 'ipc_ack' not taken"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_option_the_body_does_not_take_is_refused_naming_it(service, case):
    query, body, says = REFUSED[case]
    r = post(service, query, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["kind"] == "invalid_input" and says in r.json()["error"]["message"], r.text


def test_the_options_a_body_takes_still_work(service):
    r = post(service, "/v1/encode?wait=true&timeout_s=30&return_embeddings=false&id=opts-1", **image_body())
    assert r.status_code == 200 and r.json()["images"][0]["id"] == "u:opts-1", r.text
    r = post(service, "/v1/encode?video=true&fps=2&id=opts-clip", content=CLIP,
             headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["videos"][0]["id"] == "v:u:opts-clip", r.text
    r = post(service, "/v1/encode?fps=2", files=[("video", ("c.mp4", CLIP, "video/mp4"))])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field", ["image", "video"])
def test_an_id_in_the_query_names_a_multipart_body_s_one_item(service, field):
    """It was dropped: the answer named the item by its hash, and a fetch of the id the caller gave was 404."""
    data, id_ = (PNG, "u:mp-image") if field == "image" else (CLIP, "v:u:mp-video")
    r = post(service, f"/v1/encode?wait=true&timeout_s=30&id={id_.split(':')[-1]}",
             files=[(field, ("a", data, "application/octet-stream"))])
    assert r.status_code == 200, r.text
    (info,) = r.json()["images" if field == "image" else "videos"]
    assert info["id"] == id_
    item = info["id"] if field == "image" else f"{info['id']}#0"
    rows = info["num_tokens"] if field == "image" else info["tokens_per_group"]
    fetch = post(service, "/v1/fetch", json={"items": [{"id": item, "offset": 0}], "start": 0, "end": rows})
    assert fetch.status_code == 200, fetch.text


@pytest.mark.parametrize("body", ["image", "multipart", "json"])
def test_a_query_of_more_options_than_any_request_takes_is_refused_at_once(service, body):
    """Each name was counted against every other (names.count): ~17k names in 65 KB held the event loop 3.65 s
    per request. More than MAX_ITEMS is a 400 before a name is looked at (or the body read)."""
    query = "/v1/encode?" + "&".join(f"o{k}=1" for k in range(4000))
    sent = {"image": image_body(), "multipart": image_parts(PNG), "json": {"json": {"images": []}}}[body]
    r = post(service, query, **sent)
    assert r.status_code == 400, r.text
    assert "4000 query options, more than any request takes (32)" in r.json()["error"]["message"], r.text
    r = post(service, "/v1/fetch?" + "&".join(["timeout_s=0"] * 33), json={"items": [], "start": 0, "end": 1})
    assert r.status_code == 400 and "33 query options" in r.json()["error"]["message"], r.text
