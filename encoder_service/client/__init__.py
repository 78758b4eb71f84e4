"""Python clients for encoder_service, over HTTP (httpx) or gRPC, blocking or asyncio.

    from encoder_service.client import EncoderClient
    with EncoderClient.grpc("127.0.0.1:50051", token=...) as client:   # or EncoderClient.http("http://...")
        infos = client.encode([png_bytes, "photo.jpg", pil_image])    # answers before the ViT runs
        layout = ([(infos[0].id, 5, infos[0].num_tokens)], prompt_len)
        for chunk in client.iter_chunks(layout, chunk_size=2048):       # only the rows each chunk needs
            ...  # chunk.start, chunk.end, chunk.segments, chunk.rows

        client.release([i.id for i in infos])                            # done: end the pins early

        video = client.encode_videos(["clip.mp4"], fps=2)[0]             # a video: rows per frame group
        items = video.fetch_items(offset=5)                              # (group id, offset, rows) each

Same host as a server started with --shm-fetch: `EncoderClient.grpc(..., shm=True)` fetches through
shared-memory files (client/shm.py); `client.alloc_rows(n, row_width, dtype)` gives a buffer the server
writes into directly (pass it, or row slices of it, as `out`).

Server errors arrive as encoder_service.errors types (InvalidInput, NotFound, Overloaded, ...). A 503 /
UNAVAILABLE or an unreachable server is retried within the client's timeout first (`retry=RetryPolicy(...)`
to tune it, `retry=None` to turn it off; client/retry.py).
"""

from encoder_service.client.base import AsyncEncoderClient, EncoderClient
from encoder_service.client.retry import RetryPolicy
from encoder_service.client.types import FetchedRows, ImageInfo, ImageSource, ReleaseCount, VideoInfo, VideoSource
from encoder_service.ranges import PromptLayout, Segment

__all__ = ["AsyncEncoderClient", "EncoderClient", "FetchedRows", "ImageInfo", "ImageSource", "PromptLayout",
           "ReleaseCount", "RetryPolicy", "Segment", "VideoInfo", "VideoSource"]
