"""Error kinds on the wire, both directions: the one table of what each `EncoderServiceError.kind` is over
HTTP (status) and gRPC (status code), and which exception type a client raises for it.

The server answers an error with its kind (HTTP: the JSON body's `error.kind`; gRPC: the `error-kind`
trailing metadata) and the status of this table (api/errors.py); a client turns the kind back into the
exception (`remote_error`). Whatever else speaks our errors (the vLLM proxy, say) maps them here too, so
a kind means one status everywhere. An answer that names no kind (a proxy's error page, gRPC's own limits)
is read back by its status (`kind_from_status`).
"""

from __future__ import annotations

from dataclasses import dataclass

from encoder_service import errors


@dataclass(frozen=True)
class ErrorKind:
    http_status: int
    grpc_code: str  # the name of a grpc.StatusCode member (a name: protocol/ does not import grpc)
    error: type[errors.EncoderServiceError]  # what a client raises for it (a subclass's extra fields don't travel)


# Order matters only for `kind_from_status`: the first kind with a status is the one read back for it.
KINDS: dict[str, ErrorKind] = {
    "invalid_input": ErrorKind(400, "INVALID_ARGUMENT", errors.InvalidInput),
    "limit": ErrorKind(400, "INVALID_ARGUMENT", errors.InvalidInput),
    "payload_too_large": ErrorKind(413, "INVALID_ARGUMENT", errors.InvalidInput),
    "unsupported_media_type": ErrorKind(415, "INVALID_ARGUMENT", errors.InvalidInput),
    "request_timeout": ErrorKind(408, "INVALID_ARGUMENT", errors.RequestTimeout),  # HTTP only: a body that stalled
    "failed_precondition": ErrorKind(400, "FAILED_PRECONDITION", errors.FailedPrecondition),
    "unauthenticated": ErrorKind(401, "UNAUTHENTICATED", errors.Unauthenticated),
    "not_found": ErrorKind(404, "NOT_FOUND", errors.NotFound),
    "conflict": ErrorKind(409, "ALREADY_EXISTS", errors.Conflict),
    "overloaded": ErrorKind(429, "RESOURCE_EXHAUSTED", errors.Overloaded),
    "internal": ErrorKind(500, "INTERNAL", errors.EncoderServiceError),
    "model": ErrorKind(500, "FAILED_PRECONDITION", errors.EncoderServiceError),
    "unavailable": ErrorKind(503, "UNAVAILABLE", errors.Unavailable),
    "deadline": ErrorKind(504, "DEADLINE_EXCEEDED", errors.DeadlineExceeded),
}

# A RESOURCE_EXHAUSTED without a kind is gRPC's own message-size limit ("Received message larger than
# max"), the request's fault: our server names the kind of every overload it answers.
_GRPC_WITHOUT_KIND = {"RESOURCE_EXHAUSTED": "limit"}


def kind_of(exc: BaseException) -> str:
    """The kind `exc` is answered as: its own, or "internal" (anything not ours is a bug, never detailed)."""
    if isinstance(exc, errors.EncoderServiceError) and exc.kind in KINDS:
        return exc.kind
    return "internal"


def http_status(exc: BaseException) -> int:
    return KINDS[kind_of(exc)].http_status


def grpc_code_name(exc: BaseException) -> str:
    return KINDS[kind_of(exc)].grpc_code


def kind_from_status(status) -> str | None:
    """The kind of an error answer that named none, by its status: an HTTP status (int) or a
    `grpc.StatusCode`; None when no kind has it."""
    name = getattr(status, "name", None)
    if name is not None:
        if name in _GRPC_WITHOUT_KIND:
            return _GRPC_WITHOUT_KIND[name]
        return next((kind for kind, k in KINDS.items() if k.grpc_code == name), None)
    return next((kind for kind, k in KINDS.items() if k.http_status == status), None)


def remote_error(kind: str | None, message: str, status, retry_after_s: float | None = None
                 ) -> errors.EncoderServiceError:
    """The exception a client raises for a server's error answer, on every transport: its `kind` (None when the
    answer named none: then its `status`, an HTTP status or a grpc.StatusCode, decides), `message` and
    Retry-After. `except encoder_service.errors.NotFound` works the same for HTTP and gRPC; the raised error
    also carries `status` (what the answer arrived with)."""
    known = KINDS.get(kind if kind is not None else kind_from_status(status))
    cls = known.error if known is not None else errors.EncoderServiceError
    text = f"{message} (server answered {getattr(status, 'name', status)})"
    exc = cls(text, retry_after_s if retry_after_s is not None else 1.0) if cls is errors.Overloaded else cls(text)
    exc.status = status
    return exc
