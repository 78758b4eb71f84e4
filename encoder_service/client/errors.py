"""Server errors back as the service's own exception types (encoder_service.errors), on both transports.

`except encoder_service.errors.NotFound` works the same for HTTP and gRPC; each raised error also carries
`status` (the HTTP status or grpc.StatusCode it arrived with).
"""

from __future__ import annotations

from encoder_service import errors

_BY_KIND: dict[str, type[errors.EncoderServiceError]] = {
    "invalid_input": errors.InvalidInput,
    "limit": errors.InvalidInput,  # LimitExceeded's fields don't travel; its message names them
    "not_found": errors.NotFound,
    "overloaded": errors.Overloaded,
    "deadline": errors.DeadlineExceeded,
    "unauthenticated": errors.Unauthenticated,
    "unavailable": errors.Unavailable,
    "failed_precondition": errors.FailedPrecondition,
}
# When the server sent no kind (a proxy's answer, gRPC's own limits): the status decides.
_KIND_BY_HTTP = {400: "invalid_input", 401: "unauthenticated", 404: "not_found", 413: "limit",
                 429: "overloaded", 503: "unavailable", 504: "deadline"}
# Our server always names the kind of a RESOURCE_EXHAUSTED it raises; one without a kind comes from gRPC's
# own message-size limits ("Received message larger than max"): the request's fault, not overload.
_KIND_BY_GRPC = {"INVALID_ARGUMENT": "invalid_input", "UNAUTHENTICATED": "unauthenticated",
                 "NOT_FOUND": "not_found", "RESOURCE_EXHAUSTED": "limit", "UNAVAILABLE": "unavailable",
                 "DEADLINE_EXCEEDED": "deadline"}


def remote_error(kind: str | None, message: str, status, retry_after_s: float | None = None
                 ) -> errors.EncoderServiceError:
    if kind is None:
        name = getattr(status, "name", None)
        kind = _KIND_BY_GRPC.get(name) if name else _KIND_BY_HTTP.get(status)
    cls = _BY_KIND.get(kind, errors.EncoderServiceError)
    text = f"{message} (server answered {getattr(status, 'name', status)})"
    exc = cls(text, retry_after_s if retry_after_s is not None else 1.0) if cls is errors.Overloaded else cls(text)
    exc.status = status
    return exc
