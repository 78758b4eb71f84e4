"""Request bodies, for both HTTP apps (api/http.py and the SGLang protocol's api/sglang/http.py): read within
a byte limit, parse strict JSON into a model, decode strict base64."""

from __future__ import annotations

import asyncio
import base64
import binascii

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.types import Message, Receive

from encoder_service.errors import InvalidInput, PayloadTooLarge, RequestTimeout


MIN_BODY_RATE = 64 << 10  # bytes/s a body averages at least, after --read-timeout-s of grace (a 10 MB image: 3 min)


def bounded(request: Request, limit: int, read_timeout_s: float | None = None) -> Request:
    """A view of `request` whose body reads raise PayloadTooLarge past `limit` bytes (never buffered beyond),
    and RequestTimeout when no part of the body arrives for `read_timeout_s` (None: no bound), or when the whole
    body has not arrived by its deadline: `read_timeout_s` plus its length (Content-Length, else `limit`) at
    MIN_BODY_RATE. A client that stops sending its body (a stalled upload, a body cut short on a connection it
    keeps open), or trickles it (a byte per pause, holding the connection and what it sent), is answered and
    its connection closed (api/http.py), not held, nor counted as a client that left."""
    declared = request.headers.get("content-length")
    declared = int(declared) if declared is not None and declared.isascii() and declared.isdigit() else None
    if declared is not None and declared > limit:
        raise PayloadTooLarge.declared(declared, limit)
    received = 0
    receive: Receive = request.receive
    loop = asyncio.get_running_loop()
    allowed_s = None if read_timeout_s is None else read_timeout_s + (declared or limit) / MIN_BODY_RATE
    deadline = None if allowed_s is None else loop.time() + allowed_s

    async def bounded_receive() -> Message:
        nonlocal received
        wait_s = None if deadline is None else min(read_timeout_s, deadline - loop.time())
        try:
            if wait_s is not None and wait_s <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), wait_s)
        except TimeoutError:
            if loop.time() >= deadline:
                raise RequestTimeout(f"the request body did not arrive within {allowed_s:g}s (--read-timeout-s, "
                                     f"then {MIN_BODY_RATE >> 10} KiB/s at least): {received} bytes came") from None
            raise RequestTimeout(f"the request body stopped arriving: no byte for {read_timeout_s:g}s after "
                                 f"{received} bytes (--read-timeout-s)") from None
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise PayloadTooLarge.received(received, limit)
        return message

    return Request(request.scope, bounded_receive)


def parse(model: type[BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
        raise InvalidInput(f"bad JSON body: {problems}") from None


def b64(where: str, text: str) -> bytes:
    """Strict base64 (no characters outside the alphabet); InvalidInput naming `where`."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"{where}: not valid base64 ({exc})") from None
