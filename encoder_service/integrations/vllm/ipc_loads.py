"""Rows GPU to GPU for vLLM's workers: an item whose rows are in the encoder's device row arena (the scheduler
side's fetch found them there and holds them: fetch.py) is copied by each worker itself straight into the
tensor that becomes `encoder_cache[identifier]`: one device-to-device copy, no host memory on the way.

The copy must be made by the process that owns the destination GPU memory; the hold need not be. What rides
in vLLM's connector metadata is worker.py's `IpcRows` (plain and picklable) with the scheduler side's hold
(`IpcHold`: the arena's handle, where each segment is, the lease's deadline), so a load costs the worker no
request: it opens the handle (once per encoder process, `reader`), copies, synchronizes, and notes the
hold's token (`take_copied`), which the connector reports to the scheduler side (vLLM's worker -> scheduler
metadata, gathered from every rank before the scheduler sees it); the scheduler side acknowledges it.

A load without a usable hold (none: vLLM loads an item again; its deadline passed before the copy ended; the
arena's kind is not the reader's) is fetched by the worker's own client, by IPC with a hold of its own, else
over the socket (one log line). A refused open turns IPC off for this worker for good; the connector tells
the scheduler side (`refused`), which then stages in host memory.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from encoder_service.client import EncoderClient
from encoder_service.client.ipc import CudaIpcReader, Generations
from encoder_service.integrations.vllm.fetch import checked_rows, fetch_items
from encoder_service.integrations.vllm.options import ConnectorOptions
from encoder_service.integrations.vllm.worker import IpcHold, IpcRows
from encoder_service.protocol.dtypes import torch_dtype
from encoder_service.rowpath import cuda_ipc

log = logging.getLogger("encoder_service.integrations.vllm")


class IpcLoader:
    """One worker's loads by IPC: its reader of the encoder's arena (`reader` "auto": CUDA's; the CPU tests'
    host stand-in), its client for loads without a usable hold (made on first use, sharing the reader), a side
    stream of its device the copies run on (so that waiting for them does not wait for the model's queued
    work), and the tokens of the holds it copied under since `take_copied`."""

    def __init__(self, options: ConnectorOptions, device: torch.device | str, reader="auto"):
        self.options, self.device = options, torch.device(device)
        self.reader = CudaIpcReader() if reader == "auto" else reader
        self._generations = Generations(self.reader)  # a replica's new arena (it restarted): its old one closed
        self._client: EncoderClient | None = None
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None  # made at the first load, once vLLM has set up the device
        self._copied: list[str] = []
        self._refused: str | None = None

    def load(self, rows: IpcRows) -> torch.Tensor:
        """The item's `[num_rows, row_width]` rows on this worker's device (RuntimeError if the encoder's rows
        are not the ones planned)."""
        if self.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self._stream is None:
            return self._load(rows)
        # `out` is made on the side stream (the caching allocator ties its memory to that stream, so no work
        # queued on the model's stream still uses it), filled and synchronized there; the model's stream uses
        # it from now on (record_stream: its memory is not reused before that work is done).
        with torch.cuda.stream(self._stream):
            out = self._load(rows)
        out.record_stream(torch.cuda.current_stream(self.device))
        return out

    def take_copied(self) -> list[str]:
        """Tokens of the holds copied under since the last call (the connector reports them)."""
        taken, self._copied = self._copied, []
        return taken

    def _load(self, rows: IpcRows) -> torch.Tensor:
        out = torch.empty((rows.num_rows, rows.row_width), dtype=torch_dtype(rows.dtype), device=self.device)
        if rows.hold is not None and self.refused is None and self._copy_held(rows.hold, out):
            return out
        items, per_item = fetch_items(rows.item_id, rows.num_rows, rows.groups)
        result = self.client().fetch(items, 0, rows.num_rows, out=out)
        got = checked_rows(rows.item_id, items, per_item, result.segments)
        if got != rows.num_rows:
            raise RuntimeError(f"item {rows.item_id!r} has {got} rows at the encoder service now, "
                               f"{rows.num_rows} when it was staged: not loading it")
        return out

    def _copy_held(self, hold: IpcHold, out: torch.Tensor) -> bool:
        """The held rows into `out`, synchronized; False when they can't be used (the caller fetches)."""
        p = hold.placement
        if p.kind != self.reader.kind or time.monotonic() >= hold.deadline:
            log.info("a held load: %s; fetching it", "past its hold's deadline" if p.kind == self.reader.kind
                     else f"the encoder's arena is {p.kind}, this worker reads {self.reader.kind}")
            return False
        row_bytes = out.shape[1] * out.element_size()
        if sum(hold.counts) != len(out):
            raise RuntimeError(f"the hold covers {sum(hold.counts)} rows, the item has {len(out)}: not loading it")
        pieces = []
        for offset, position, count in zip(p.offsets, hold.positions, hold.counts):
            if offset % out.element_size() or offset + count * row_bytes > p.size or position + count > len(out):
                raise RuntimeError(f"held rows at arena offset {offset} (+{count} rows at row {position}) are "
                                   f"outside the {p.size}-byte arena or the item's {len(out)} rows")
            pieces.append((offset, count * row_bytes, out[position:position + count]))
        self._copied.append(p.token)  # reported after this step whatever happens below: nobody reads later
        try:
            self.reader.copy(p.handle, p.generation, pieces)
            self.reader.synchronize(out.device)
            self._generations.seen(hold.server, p.generation)
        except (cuda_ipc.CudaIpcError, OSError, RuntimeError) as exc:
            self._refused = f"{type(exc).__name__}: {exc}"
            log.warning("opening the encoder's IPC memory failed here (%s): fetching from now on", exc)
            return False
        if time.monotonic() >= hold.deadline:  # the encoder may have reused those bytes meanwhile
            log.info("a held load's copy ended past its hold's deadline; fetching it")
            return False
        return True

    def client(self) -> EncoderClient:
        with self._lock:
            if self._client is None:
                o = self.options
                self._client = EncoderClient.http(o.url, token=o.auth_token, timeout=o.fetch_timeout_s,
                                                  ipc="off" if self._refused else self.reader,
                                                  ipc_channel=o.ipc_channel == "auto")
            return self._client

    @property
    def refused(self) -> str | None:
        """Why this worker no longer loads by IPC (an open refused here), else None."""
        if self._refused is None and self._client is not None and self._client.ipc_off is not None:
            self._refused = self._client.ipc_off
        return self._refused

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
        self.reader.close()
