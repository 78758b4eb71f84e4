"""Errors as answers, for every transport of the server: the status of each kind comes from the one table
(protocol/errors.py: KINDS); here are the bodies and headers built from it.

Every error the core raises is an `encoder_service.errors.EncoderServiceError`; anything else reaching a
transport is an internal error (500 / INTERNAL) and is logged with its traceback there.
"""

from __future__ import annotations

from encoder_service import errors
from encoder_service.protocol.errors import grpc_code_name, http_status

# http_status (protocol/errors.py's) is part of the server's answers: the transports and the vLLM proxy take it here.
__all__ = ["answer_headers", "error_body", "grpc_code", "http_status", "retry_after_header"]


def grpc_code(exc: BaseException):
    """The `grpc.StatusCode` for `exc` (imports grpc lazily)."""
    import grpc

    return getattr(grpc.StatusCode, grpc_code_name(exc))


def error_body(exc: BaseException) -> dict:
    """JSON body of an error answer: {"error": {"kind", "message"[, "retry_after_s"]}}."""
    if not isinstance(exc, errors.EncoderServiceError):  # a bug: its details stay in the log
        return {"error": {"kind": "internal", "message": "internal error"}}
    body = {"kind": exc.kind, "message": exc.message}
    if isinstance(exc, errors.Overloaded):
        body["retry_after_s"] = exc.retry_after_s
    return {"error": body}


def retry_after_header(exc: BaseException) -> str | None:
    """Retry-After value (whole seconds, at least 1) for an Overloaded error, else None."""
    if isinstance(exc, errors.Overloaded):
        return str(max(1, int(-(-exc.retry_after_s // 1))))
    return None


def answer_headers(exc: BaseException) -> dict[str, str]:
    """HTTP headers of an error answer, on every HTTP port: Retry-After for an Overloaded error; `connection:
    close` for a RequestTimeout (the rest of its body may come later: not a next request's bytes)."""
    headers = {}
    retry = retry_after_header(exc)
    if retry is not None:
        headers["retry-after"] = retry
    if isinstance(exc, errors.RequestTimeout):
        headers["connection"] = "close"
    return headers
