"""The fetch payload as an HTTP response whose rows leave the cache entry's memory without being joined.

Starlette's Response sends one `bytes` body, so the rows would be copied into it (with the header in front);
a StreamingResponse sends chunked, which plain HTTP/1.1 readers handle worse than a Content-Length body.
`RowsResponse` announces Content-Length, sends the small prefix (wire header), then the rows as memoryview
slices of SEND_BYTES, each its own ASGI body message. uvicorn's httptools protocol writes each slice to the
transport as is; its h11 protocol frames each slice with one copy of that slice. What the socket did not take
yet, asyncio keeps as a memoryview on Python >= 3.12 (no copy) but copies into a bytearray on 3.11. Between
slices uvicorn waits for the transport to drain, so a connection holds about one slice of unsent bytes and the
loop serves other requests in between. Measured as server CPU per GB sent, slices cost within 10% of one
whole-body message on 3.12 with httptools and under half of it on 3.11 or with h11 (which copy a whole body
once more); most of that CPU is the kernel's send path (system time) either way. So when uvicorn serves with
httptools, a pool thread writes the rows on the socket instead (api/socket_send.py: several fetches' copies
run at once, off the loop); the slices are the fallback.

`delivered` says, once the response was sent, whether the rows reached the connection: False when the client
left before they were all handed over (the thread's send failed; or, on the slice path, the server saw the
connection close: uvicorn then drops what is sent, silently). The request's metrics count that `cancelled`
(api/http.py observes a request until its answer is sent).
"""

from __future__ import annotations

import asyncio
from typing import Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from encoder_service.api.socket_send import EXTENSION, NOT_TAKEN, SENT

# Rows per body message: about what a loopback socket takes in one send, so most slices go to the kernel at
# once; large enough that the per-message cost (an await, a transport write) is negligible.
SEND_BYTES = 4 << 20


class RowsResponse(Response):
    def __init__(self, prefix: bytes, rows: memoryview, media_type: str, headers: Mapping[str, str]):
        self._prefix, self._rows = prefix, rows
        self.delivered = False  # (module docstring)
        super().__init__(None, 200, {**headers, "content-length": str(len(prefix) + len(rows))}, media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        rows, last = self._rows, max(0, len(self._rows) - SEND_BYTES)
        await send({"type": "http.response.body", "body": self._prefix, "more_body": bool(len(rows))})
        writer = scope.get("extensions", {}).get(EXTENSION)
        outcome = await writer.write(rows) if writer is not None else NOT_TAKEN
        if outcome == SENT:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if outcome != NOT_TAKEN:
            self.delivered = outcome == SENT
            return
        # The request's body is read: until the response ends, receive() answers only a disconnect.
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            for lo in range(0, len(rows), SEND_BYTES):
                await asyncio.sleep(0)  # the watch runs (a send to a closed connection returns at once)
                if gone.done():
                    return
                await send({"type": "http.response.body", "body": rows[lo:lo + SEND_BYTES], "more_body": lo < last})
            self.delivered = True
        finally:
            # Not awaited: the request is counted in this same step of the loop as its last bytes were written,
            # so a client that has read them and then asks the metrics sees it counted.
            gone.cancel()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
