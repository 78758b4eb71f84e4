"""The query options of the HTTP endpoints, in one place, checked as strictly as JSON bodies are: an option the
endpoint does not take with the body sent (unknown, or `fps` on an image), or one given twice, is a 400 naming
it, never ignored. A query of more than MAX_ITEMS options is a 400 before any is looked at: no endpoint takes
more than a dozen, and the check's cost must not grow with what a client sends.

  POST /v1/encode   an image body (image/*, application/octet-stream): wait, return_embeddings, timeout_s, id,
                    ipc_host, ipc_ack
                    a video body (video/*, or application/octet-stream with video=true): wait,
                    return_embeddings, timeout_s, id and the video options (protocol/video_request.py: OPTIONS)
                    multipart: as an image body or a video body, by the fields it holds (`id` only when it
                    holds one image or one video)
                    JSON: none (its options are in the body)
  POST /v1/fetch, /v1/fetch/ack, /v1/fetch/pickup, /v1/release: none (JSON bodies)
The values are read where they are used (api/http.py, api/video_bodies.py).
"""

from __future__ import annotations

from collections import Counter

from encoder_service.errors import InvalidInput
from encoder_service.protocol.video_request import OPTIONS

ENCODE = ("wait", "return_embeddings", "timeout_s")
IMAGE = (*ENCODE, "id", "ipc_host", "ipc_ack")  # ipc_*: the answer carries each image's IPC hold
VIDEO = (*ENCODE, "id", *OPTIONS)
OCTET = ("video",)  # an application/octet-stream body: video=true makes it a video
MAX_ITEMS = 32  # query options of one request, repeats counted (a video body takes the most: 11)
_SHOWN = 5  # offending names listed at most (each cut to 40 characters: a query is the caller's text)


def check(query, allowed: tuple[str, ...], where: str) -> None:
    """InvalidInput naming every option of `query` (starlette's QueryParams) not in `allowed`, or any given
    more than once; `where` says what was sent to where ("POST /v1/encode with an image body")."""
    names = bounded(query, where)
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise InvalidInput(f"{where}: query option {_listed(repeated)} given more than once")
    refused = [name for name in dict.fromkeys(names) if name not in allowed]
    if not refused:
        return
    takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
    video_only = [name for name in refused if name in OPTIONS]
    note = f"; {_listed(video_only)} only with a video" if video_only and "id" in allowed else ""
    raise InvalidInput(f"{where}: query option {_listed(refused)} not taken ({takes}{note})")


def bounded(query, where: str) -> list[str]:
    """The names of `query`'s options, in order; InvalidInput past MAX_ITEMS (checked before a body is read)."""
    names = [name for name, _ in query.multi_items()]
    if len(names) > MAX_ITEMS:
        raise InvalidInput(f"{where}: {len(names)} query options, more than any request takes ({MAX_ITEMS})")
    return names


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"{name!r:.40}" for name in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
