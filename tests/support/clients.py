"""Client builders shared by the client tests: one per transport, against a RunningService."""

from __future__ import annotations

from encoder_service.client import AsyncEncoderClient, EncoderClient


def sync_client(svc, transport: str, **kw) -> EncoderClient:
    return EncoderClient.http(svc.url, timeout=30, **kw) if transport == "http" else \
        EncoderClient.grpc(svc.grpc_address, timeout=30, **kw)


def async_client(svc, transport: str, **kw) -> AsyncEncoderClient:
    return AsyncEncoderClient.http(svc.url, timeout=30, **kw) if transport == "http" else \
        AsyncEncoderClient.grpc(svc.grpc_address, timeout=30, **kw)
