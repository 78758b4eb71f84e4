"""One request's identity, for every transport (HTTP, gRPC, the SGLang protocol): its request id, taken
from the caller's `x-request-id` (HTTP header, gRPC metadata) when it is a sane one, else made here, and
echoed in the answer (HTTP header, gRPC trailing metadata); every log line written while serving it carries
it (`record.request_id`, "-" outside requests: `install_log_ids` once per process); its metrics
(`Metrics.observe`); and, with --access-log, one INFO line when it ends.

    with served(metrics, "http", "encode", request.headers.get(REQUEST_ID), access_log=True) as serving:
        ... serving.request_id, serving.observed.failed(exc) ...
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from encoder_service.core.metrics import Metrics, Observed

REQUEST_ID = "x-request-id"
# What a caller's id may be: printable, no spaces, bounded, so a log line cannot be forged or flooded with it.
_SANE = re.compile(r"^[A-Za-z0-9._:/@+=\-]{1,128}$")
_current: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_access = logging.getLogger("encoder_service.access")


@dataclass
class Served:
    request_id: str
    observed: Observed


def request_id(given: str | None) -> str:
    """The caller's id when it is a sane one, else a new one (32 hex digits)."""
    return given if given is not None and _SANE.match(given) else uuid.uuid4().hex


@contextlib.contextmanager
def served(metrics: Metrics, transport: str, method: str, given_id: str | None, *,
           access_log: bool) -> Iterator[Served]:
    """Serve one request: its id in the context (log lines), its metrics, its access line."""
    rid = request_id(given_id)
    token = _current.set(rid)
    try:
        with metrics.observe(transport, method) as observed:
            yield Served(rid, observed)
    finally:
        if access_log:
            _access.info("%s %s %s %.6fs request_id=%s", transport, method, observed.outcome, observed.seconds,
                            rid)
        _current.reset(token)


def install_log_ids() -> None:
    """Every log record gets `request_id` (the request being served, "-" outside requests), so a format may
    name it (cli.py's does). Once per process; later calls do nothing."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "adds_request_id", False):
        return

    def record(*args, **kwargs) -> logging.LogRecord:
        rec = factory(*args, **kwargs)
        rec.request_id = _current.get()
        return rec

    record.adds_request_id = True
    logging.setLogRecordFactory(record)
