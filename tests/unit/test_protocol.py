"""protocol/ owns both directions of every message: an encode answer through HTTP JSON and the gRPC message
and back, and the one error-kind table (kind -> HTTP status, gRPC code, the client's exception type) read
in both directions. Metrics.observe, the request observation every transport shares."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import grpc
import pytest

from encoder_service import errors
from encoder_service.api import errors as api_errors
from encoder_service.cache import CorruptEntry
from encoder_service.replicas import EncodeFailed
from encoder_service.client.base import ImageInfo as ClientImageInfo
from encoder_service.core.metrics import Metrics
from encoder_service.protocol import errors as kinds
from encoder_service.protocol.errors import remote_error
from encoder_service.protocol.grpc_messages import info_from_proto, info_to_proto
from encoder_service.protocol.image_info import ImageInfo

INFO = ImageInfo(id="u:doc-7", grid_thw=(1, 4, 6), num_tokens=6, row_width=192, hidden_size=48,
                 layout="main+deepstack3", dtype="bfloat16", cached=True)


def test_an_image_info_goes_both_ways_through_json_and_the_message():
    d = INFO.to_json()
    assert d["grid_thw"] == [1, 4, 6] and set(d) == {f.name for f in dataclasses.fields(ImageInfo)}
    assert ImageInfo.from_json(d | {"embedding": "ignored here"}) == INFO
    assert info_from_proto(info_to_proto(INFO)) == INFO
    # The client's subclass, with its own field filled by the caller.
    mine = ClientImageInfo.from_json(d, embedding=None)
    assert isinstance(mine, ClientImageInfo) and mine.to_json() == d
    assert info_from_proto(info_to_proto(mine), ClientImageInfo, embedding=None) == mine


def _service_errors() -> list[type[errors.EncoderServiceError]]:
    return [c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.EncoderServiceError)]


def test_every_kind_maps_both_ways():
    raised = {cls.kind for cls in _service_errors()} | {CorruptEntry.kind}
    assert raised <= set(kinds.KINDS), "give each new error kind a row in protocol/errors.py"
    for kind, row in kinds.KINDS.items():
        code = getattr(grpc.StatusCode, row.grpc_code)
        # Read back by status alone (an answer without a kind): a kind answered with that status. gRPC's
        # own RESOURCE_EXHAUSTED (a message over its size limit) is the request's fault, not overload.
        assert kinds.KINDS[kinds.kind_from_status(row.http_status)].http_status == row.http_status, kind
        back = kinds.kind_from_status(code)
        assert kinds.KINDS[back].grpc_code == row.grpc_code or (row.grpc_code, back) == ("RESOURCE_EXHAUSTED", "limit")
        err = remote_error(kind, "why", row.http_status)
        assert type(err) is row.error and err.message.startswith("why") and err.status == row.http_status


@pytest.mark.parametrize("kind, status", [("request_timeout", 408), (None, 408)])
def test_a_408_is_raised_as_a_request_timeout(kind, status):
    """It was a plain InvalidInput: a client could not tell a body the server stopped waiting for (send it
    again) from a bad request."""
    err = remote_error(kind, "the request body stopped arriving", status)
    assert type(err) is errors.RequestTimeout and isinstance(err, errors.InvalidInput)


def test_statuses_by_kind_not_by_message():
    assert api_errors.http_status(errors.PayloadTooLarge("request body bytes", 9, 8)) == 413
    assert api_errors.http_status(errors.LimitExceeded("request body bytes", 9, 8)) == 400  # no message matching
    assert api_errors.http_status(errors.UnsupportedMediaType("text/plain")) == 415
    assert api_errors.grpc_code(errors.Overloaded("full")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Another replica's failure keeps that replica's kind; an unknown kind, and anything not ours, is internal.
    assert api_errors.http_status(EncodeFailed("truncated", "invalid_input")) == 400
    assert api_errors.http_status(EncodeFailed("?", "no_such_kind")) == 500
    assert api_errors.http_status(KeyError("bug")) == 500
    assert api_errors.error_body(KeyError("secret detail")) == {"error": {"kind": "internal",
                                                                         "message": "internal error"}}


async def test_observe_counts_each_outcome_once():
    metrics = Metrics()

    def sample(name: str, **labels) -> float:
        return metrics.registry.get_sample_value(name, labels) or 0.0

    with metrics.observe("http", "encode"):
        assert sample("encoder_in_flight_requests") == 1
    with metrics.observe("http", "encode") as observed:
        observed.failed(errors.NotFound("gone"))
    with metrics.observe("http", "encode") as observed:
        observed.failed(ValueError("a bug"))

    async def left():
        with metrics.observe("grpc", "fetch"):
            await asyncio.Event().wait()

    task = asyncio.create_task(left())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [sample("encoder_requests_total", transport="http", method="encode", outcome=o)
            for o in ("ok", "not_found", "internal")] == [1, 1, 1]
    assert sample("encoder_requests_total", transport="grpc", method="fetch", outcome="cancelled") == 1
    assert sample("encoder_request_seconds_count", transport="http", method="encode") == 3
    assert sample("encoder_request_ms_count", transport="http", method="encode") == 3  # deprecated twin
    assert sample("encoder_in_flight_requests") == 0
    # The same observations in both: seconds, and the deprecated ms (buckets at the same bounds).
    seconds = sample("encoder_request_seconds_sum", transport="http", method="encode")
    assert sample("encoder_request_ms_sum", transport="http", method="encode") == pytest.approx(seconds * 1e3)
