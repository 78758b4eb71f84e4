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


def bounded(request: Request, limit: int, read_timeout_s: float | None = None) -> Request:
    """A view of `request` whose body reads raise PayloadTooLarge past `limit` bytes (never buffered beyond),
    and RequestTimeout when no part of the body arrives for `read_timeout_s` (None: no bound): a client that
    stops sending its body (a stalled upload, a body cut short on a connection it keeps open) is answered and
    its connection closed (api/http.py), not held, nor counted as a client that left."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge.declared(int(declared), limit)
    received = 0
    receive: Receive = request.receive

    async def bounded_receive() -> Message:
        nonlocal received
        try:
            message = await asyncio.wait_for(receive(), read_timeout_s)
        except TimeoutError:
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
