"""The worker side, vLLM-free: where an item's staged rows are (`ShmRows`, or `IpcRows`: left on the encoder's
GPU; `ItemLoad`: what the scheduler side puts into the step's metadata) and the copy onto the worker's device
(`RowLoader`; rows left on the encoder's GPU: ipc_loads.py)."""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from encoder_service.protocol.dtypes import torch_dtype
from encoder_service.protocol.ipc import IpcPlacement
from encoder_service.protocol.shm import NAME_RE

log = logging.getLogger("encoder_service.integrations.vllm")


class _RowsBytes:
    """`nbytes` of a record with `num_rows`, `row_width` and `dtype` (a dtype's name)."""

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_width * torch_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ShmRows(_RowsBytes):
    """Where an item's staged rows are: `num_rows` rows of `row_width` `dtype` values at byte `offset` of
    the file `directory/name`. Plain and picklable (it rides in vLLM's scheduler output)."""

    name: str
    directory: str
    offset: int
    num_rows: int
    row_width: int
    dtype: str


@dataclass(frozen=True)
class IpcHold:
    """Where the scheduler side's fetch found an item's rows in the encoder's device row arena, held there for
    one step's loads (protocol/ipc.py: IpcPlacement, with its token): segment k's `counts[k]` rows are at
    arena byte `placement.offsets[k]` and go to rows `positions[k]`.. of the item. The workers copy them
    before `deadline` (time.monotonic() of this host: the hold's lease from before the scheduler side's
    request) and report the token (connector.py: worker metadata); the scheduler side then acknowledges it.
    `server`: the address of the replica that holds them (a new arena generation from it: it restarted)."""

    placement: IpcPlacement
    positions: tuple[int, ...]
    counts: tuple[int, ...]
    deadline: float
    server: str = ""


@dataclass(frozen=True)
class IpcRows(_RowsBytes):
    """An item's rows left on the encoder's GPU, in its device row arena (each worker copies them itself by
    IPC: ipc_loads.py): our id, a video's frame groups (None: an image), the rows' shape and dtype, and the
    scheduler side's hold on them for this load (None: the worker fetches them with a hold of its own). Plain
    and picklable, as ShmRows."""

    item_id: str
    groups: int | None
    num_rows: int
    row_width: int
    dtype: str
    hold: IpcHold | None = None


@dataclass(frozen=True)
class ItemLoad:
    """One item for a worker to load this step: vLLM's key and the rows it planned, and where they are."""

    identifier: str
    num_rows: int
    rows: ShmRows | IpcRows


class _Mapped:
    """A staging file mapped in a worker (MAP_SHARED, read as written by the scheduler's process)."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.registered = False

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        self.bytes = None
        self.mm.close()


class RowLoader:
    """Worker side: staged rows onto this worker's device, `[num_rows, row_width]` in `dtype`.

    The scheduler side stages items in a few large files (arenas), so a worker keeps each file mapped
    (`retain` unmaps those no longer in use). On CUDA a mapping is registered with the driver
    (cudaHostRegister: page-locked), so the copy is a DMA that does not stall the host; without it (or if
    registration fails) it is an ordinary pageable copy. Rows left on the encoder's GPU (IpcRows) are fetched
    by `ipc` (ipc_loads.py: IpcLoader) straight onto the device.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype | None = None, *, pin: bool = True, ipc=None):
        self.device, self.dtype = torch.device(device), dtype
        self.pin = pin and self.device.type == "cuda"
        self.ipc = ipc
        self._maps: dict[str, _Mapped] = {}

    def load(self, load: ItemLoad, row_width: int | None = None) -> torch.Tensor:
        """The item's rows on the device. `row_width`: what the model takes; the staged rows must have
        exactly vLLM's planned row count and that width, else RuntimeError (nothing is loaded)."""
        rows = load.rows
        if rows.num_rows != load.num_rows or (row_width is not None and rows.row_width != row_width):
            raise RuntimeError(f"staged rows of {load.identifier} are {rows.num_rows} x {rows.row_width}, the "
                               f"model planned {load.num_rows} x {row_width}: not loading them")
        src_dtype = torch_dtype(rows.dtype)
        if isinstance(rows, IpcRows):
            if self.ipc is None:
                raise RuntimeError(f"{load.identifier}: rows on the encoder's GPU, and this worker fetches none")
            out = self.ipc.load(rows)
        else:
            m = self._map(rows)
            src = m.bytes[rows.offset:rows.offset + rows.nbytes].view(src_dtype).view(rows.num_rows, rows.row_width)
            out = torch.empty((rows.num_rows, rows.row_width), dtype=src_dtype, device=self.device)
            out.copy_(src, non_blocking=m.registered)
        return out if self.dtype in (None, src_dtype) else out.to(self.dtype)

    def retain(self, names: Iterable[str]) -> None:
        """Unmap the files not in `names` (the arenas the scheduler side still has)."""
        keep = set(names)
        stale = [n for n in self._maps if n not in keep]
        if stale and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # copies from those mappings may still be in flight
        for name in stale:
            self._maps.pop(name).close()

    def close(self) -> None:
        self.retain(())
        if self.ipc is not None:
            self.ipc.close()

    def _map(self, rows: ShmRows) -> _Mapped:
        if not NAME_RE.match(rows.name):
            raise RuntimeError(f"not a staging file name: {rows.name!r}")
        m = self._maps.get(rows.name)
        if m is None:  # an arena never changes size: one mapping per file for as long as it is in use
            m = self._maps[rows.name] = _Mapped(os.path.join(rows.directory, rows.name))
            if self.pin:
                try:
                    err = torch.cuda.cudart().cudaHostRegister(m.bytes.data_ptr(), m.size, 0)
                    m.registered = int(getattr(err, "value", err)) == 0
                except Exception as exc:  # noqa: BLE001 - pageable copies work too
                    err = exc
                if not m.registered:
                    log.warning("cudaHostRegister of %s failed (%s): pageable copies from now on", rows.name, err)
                    self.pin = False
        if m.size < rows.offset + rows.nbytes:
            raise RuntimeError(f"{rows.name} is {m.size} bytes, the staged rows end at {rows.offset + rows.nbytes}")
        return m
