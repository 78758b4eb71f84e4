"""Server errors back as the service's own exception types (encoder_service.errors), on both transports.

`except encoder_service.errors.NotFound` works the same for HTTP and gRPC; each raised error also carries
`status` (the HTTP status or grpc.StatusCode it arrived with). Kinds and types: protocol/errors.py.
"""

from __future__ import annotations

from encoder_service import errors
from encoder_service.protocol.errors import KINDS, kind_from_status


def remote_error(kind: str | None, message: str, status, retry_after_s: float | None = None
                 ) -> errors.EncoderServiceError:
    """The exception for a server's error answer: its `kind` (None when the answer named none: then its
    `status`, an HTTP status or a grpc.StatusCode, decides), `message` and Retry-After."""
    known = KINDS.get(kind if kind is not None else kind_from_status(status))
    cls = known.error if known is not None else errors.EncoderServiceError
    text = f"{message} (server answered {getattr(status, 'name', status)})"
    exc = cls(text, retry_after_s if retry_after_s is not None else 1.0) if cls is errors.Overloaded else cls(text)
    exc.status = status
    return exc
