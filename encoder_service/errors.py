"""One error type for the whole service, mapped once per transport (HTTP status / gRPC code) by its `kind`
(protocol/errors.py has the table).

Raise a subclass with a message that names what was wrong, the limit and the value.
"""

from __future__ import annotations


class EncoderServiceError(Exception):
    """Base class. `kind` selects the transport mapping (protocol/errors.py: KINDS)."""

    kind = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def prefixed(self, prefix: str) -> EncoderServiceError:
        """A copy of this error (same type and fields) whose message starts with `prefix`, e.g. "image 2: ".
        A copy, not an edit: one failure may reach many waiters, each naming its own image."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.message = prefix + self.message
        copy.args = (copy.message,)
        return copy


class InvalidInput(EncoderServiceError):
    """The request itself is wrong: bad bytes, bad base64, bad ranges. HTTP 400 / INVALID_ARGUMENT."""

    kind = "invalid_input"


class ImageDecodeError(InvalidInput):
    """Bytes that are not a decodable image (corrupt, truncated, unknown format)."""


class VideoDecodeError(InvalidInput):
    """Bytes that are not a decodable video (corrupt, truncated, unsupported container or codec, no video
    stream, no frames)."""


class UnsupportedMediaType(InvalidInput):
    """A body of a content type the endpoint does not take. HTTP 415 / INVALID_ARGUMENT."""

    kind = "unsupported_media_type"


class LimitExceeded(InvalidInput):
    """A configured limit was exceeded (bytes, pixels, aspect ratio, image count). HTTP 400 / INVALID_ARGUMENT."""

    kind = "limit"

    def __init__(self, what: str, value, limit, hint: str = ""):
        super().__init__(f"{what} is {value}, over the limit of {limit}" + (f": {hint}" if hint else ""))
        self.what, self.value, self.limit = what, value, limit


class PayloadTooLarge(LimitExceeded):
    """The request body is over --max-body-bytes. HTTP 413 / INVALID_ARGUMENT."""

    kind = "payload_too_large"

    @classmethod
    def declared(cls, length: int, limit: int) -> PayloadTooLarge:
        """A body whose Content-Length is over `limit` (refused unread)."""
        return cls("request body bytes (Content-Length)", length, f"{limit} (--max-body-bytes)")

    @classmethod
    def received(cls, received: int, limit: int) -> PayloadTooLarge:
        """A body without Content-Length (chunked) found over `limit` while read: `received` bytes so far (the
        rest is never read, so its size is unknown)."""
        return cls("request body bytes (no Content-Length: counted while read)", f"at least {received}",
                   f"{limit} (--max-body-bytes)")


class RequestTimeout(InvalidInput):
    """The request did not arrive in time: its body stopped coming for --read-timeout-s (HTTP; the connection
    is closed). HTTP 408 / INVALID_ARGUMENT."""

    kind = "request_timeout"


class NotFound(EncoderServiceError):
    """Unknown or evicted id. HTTP 404 / NOT_FOUND."""

    kind = "not_found"


class Conflict(EncoderServiceError):
    """An id sent with other content than it already names (a caller id reused for another image): an id
    never names two contents. HTTP 409 / ALREADY_EXISTS."""

    kind = "conflict"


class Overloaded(EncoderServiceError):
    """Queue full or pins exhausted. HTTP 429 / RESOURCE_EXHAUSTED, with a retry hint."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(EncoderServiceError):
    """The request's deadline passed before it completed. HTTP 504 / DEADLINE_EXCEEDED."""

    kind = "deadline"


class Unauthenticated(EncoderServiceError):
    """Missing or wrong bearer token. HTTP 401 / UNAUTHENTICATED."""

    kind = "unauthenticated"


class Unavailable(EncoderServiceError):
    """Backend failure (the ViT batch failed, not ready). HTTP 503 / UNAVAILABLE."""

    kind = "unavailable"


class Unreachable(Unavailable):
    """The clients' own: the server could not be reached (connection refused, the connect's deadline passed),
    so the request was never sent. Retried as a 503 is (client/retry.py)."""


class FailedPrecondition(EncoderServiceError):
    """The request is well formed but this server is not set up for it (e.g. shared-memory fetch is off).
    HTTP 400 / FAILED_PRECONDITION: retrying the same request here will not help."""

    kind = "failed_precondition"


class ModelLoadError(EncoderServiceError):
    """Checkpoint problems: unsupported architecture, missing/unexpected/mis-shaped weights."""

    kind = "model"
