"""One mapping of error kinds to HTTP status and gRPC status code, used by both transports.

Every error the core raises is an `encoder_service.errors.EncoderServiceError`; anything else reaching a
transport is an internal error (500 / INTERNAL) and is logged with its traceback there.
"""

from __future__ import annotations

from dataclasses import dataclass

from encoder_service import errors


class UnsupportedMediaType(errors.InvalidInput):
    """A body of a content type the endpoint does not take. HTTP 415 / INVALID_ARGUMENT."""

    kind = "unsupported_media_type"


@dataclass(frozen=True)
class ErrorMapping:
    http_status: int
    grpc_code: str  # name of a grpc.StatusCode member (kept as a name so this module does not import grpc)


KINDS: dict[str, ErrorMapping] = {
    "invalid_input": ErrorMapping(400, "INVALID_ARGUMENT"),
    "limit": ErrorMapping(400, "INVALID_ARGUMENT"),
    "unsupported_media_type": ErrorMapping(415, "INVALID_ARGUMENT"),
    "not_found": ErrorMapping(404, "NOT_FOUND"),
    "overloaded": ErrorMapping(429, "RESOURCE_EXHAUSTED"),
    "deadline": ErrorMapping(504, "DEADLINE_EXCEEDED"),
    "unauthenticated": ErrorMapping(401, "UNAUTHENTICATED"),
    "unavailable": ErrorMapping(503, "UNAVAILABLE"),
    "failed_precondition": ErrorMapping(400, "FAILED_PRECONDITION"),
    "model": ErrorMapping(500, "FAILED_PRECONDITION"),
    "internal": ErrorMapping(500, "INTERNAL"),
}

# Limits on the size of what the client sent are 413 over HTTP (still INVALID_ARGUMENT over gRPC).
_PAYLOAD_TOO_LARGE = ("request body",)


def mapping(exc: BaseException) -> ErrorMapping:
    if not isinstance(exc, errors.EncoderServiceError):
        return KINDS["internal"]
    if isinstance(exc, errors.LimitExceeded) and any(str(exc.what).startswith(w) for w in _PAYLOAD_TOO_LARGE):
        return ErrorMapping(413, "INVALID_ARGUMENT")
    return KINDS.get(exc.kind, KINDS["internal"])


def http_status(exc: BaseException) -> int:
    return mapping(exc).http_status


def grpc_code(exc: BaseException):
    """The `grpc.StatusCode` for `exc` (imports grpc lazily)."""
    import grpc

    return getattr(grpc.StatusCode, mapping(exc).grpc_code)


def error_body(exc: BaseException) -> dict:
    """JSON body of an error answer: {"error": {"kind", "message"[, "retry_after_s"]}}."""
    if isinstance(exc, errors.EncoderServiceError):
        body = {"kind": exc.kind, "message": exc.message}
        if isinstance(exc, errors.Overloaded):
            body["retry_after_s"] = exc.retry_after_s
    else:
        body = {"kind": "internal", "message": "internal error"}
    return {"error": body}


def retry_after_header(exc: BaseException) -> str | None:
    """Retry-After value (whole seconds, at least 1) for an Overloaded error, else None."""
    if isinstance(exc, errors.Overloaded):
        return str(max(1, int(-(-exc.retry_after_s // 1))))
    return None
