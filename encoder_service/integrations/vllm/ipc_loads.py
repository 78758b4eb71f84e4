"""Rows GPU to GPU for vLLM's workers: an item whose rows are in the encoder's device row arena (the scheduler
side's probe found them there: fetch.py) is loaded by each worker itself, with our client's fetch by IPC
(client/ipc.py) straight into the tensor that becomes `encoder_cache[identifier]`: one device-to-device copy,
no host memory on the way.

Why the worker fetches (and not the scheduler side, as for host staging): the copy must be made by the
process that owns the destination GPU memory, and the hold that keeps the encoder from reusing those bytes
is per fetch, acknowledged by its own consumer once its copy is done (with tensor parallelism each rank
makes its own fetch and hold: nothing to count across processes). What rides in vLLM's connector metadata
is worker.py's `IpcRows` (plain and picklable: ids and sizes, no handle).

A worker whose fetch by IPC cannot be served (the rows left the arena since the probe, or this process may
not open the encoder's handle) still gets the rows from the same call: the client falls back to the socket
(one log line). A refused open turns IPC off for the worker's client for good; the connector tells the
scheduler side (`refused`, through vLLM's worker -> scheduler metadata), which then stages in host memory.
"""

from __future__ import annotations

import threading

import torch

from encoder_service.client import EncoderClient
from encoder_service.integrations.vllm.fetch import checked_rows, fetch_items
from encoder_service.integrations.vllm.options import ConnectorOptions
from encoder_service.integrations.vllm.worker import IpcRows
from encoder_service.protocol.dtypes import torch_dtype


class IpcLoader:
    """One worker's fetches by IPC: its client (made on first use), and a side stream of its device the
    copies run on, so that waiting for them does not wait for the model's queued work. `reader`: the client's
    IPC reader ("auto": CUDA; the CPU tests' host stand-in)."""

    def __init__(self, options: ConnectorOptions, device: torch.device | str, reader="auto"):
        self.options, self.device, self._reader = options, torch.device(device), reader
        self._client: EncoderClient | None = None
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None  # made at the first load, once vLLM has set up the device

    def load(self, rows: IpcRows) -> torch.Tensor:
        """The item's `[num_rows, row_width]` rows on this worker's device (RuntimeError if the encoder's rows
        are not the ones planned)."""
        items, per_item = fetch_items(rows.item_id, rows.num_rows, rows.groups)
        client = self.client()
        if self.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self._stream is None:
            out = torch.empty((rows.num_rows, rows.row_width), dtype=torch_dtype(rows.dtype), device=self.device)
            result = client.fetch(items, 0, rows.num_rows, out=out)
        else:
            # `out` is made on the side stream (the caching allocator ties its memory to that stream, so no
            # work queued on the model's stream still uses it), filled and synchronized there; the model's
            # stream uses it from now on (record_stream: its memory is not reused before that work is done).
            with torch.cuda.stream(self._stream):
                out = torch.empty((rows.num_rows, rows.row_width), dtype=torch_dtype(rows.dtype), device=self.device)
                result = client.fetch(items, 0, rows.num_rows, out=out)
            out.record_stream(torch.cuda.current_stream(self.device))
        got = checked_rows(rows.item_id, items, per_item, result.segments)
        if got != rows.num_rows:
            raise RuntimeError(f"item {rows.item_id!r} has {got} rows at the encoder service now, "
                               f"{rows.num_rows} when it was staged: not loading it")
        return out

    def client(self) -> EncoderClient:
        with self._lock:
            if self._client is None:
                o = self.options
                self._client = EncoderClient.http(o.url, token=o.auth_token, timeout=o.fetch_timeout_s,
                                                  ipc=self._reader)
            return self._client

    @property
    def refused(self) -> str | None:
        """Why this worker's client no longer tries IPC (an open refused here), else None."""
        return self._client.ipc_off if self._client is not None else None

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
