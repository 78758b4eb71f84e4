"""The core's side of the fetch by IPC (protocol/ipc.py): a consumer on this host gets where a chunk's rows sit
in the device row arena (runtime/device_arena.py) instead of the rows, copies them GPU to GPU, and
acknowledges.

`refusal(request)` is asked before any wait (core/fetch_destination.py): IPC off here, or the consumer on
another host, is answered at once, as is an id this replica neither holds nor encodes (`not_here`: with the
owner's address, so the consumer asks it; no rows are pulled from it here, no pin of it ends). `answer(request,
parts, delivered)` runs once the fetch has its segments' rows in hand (as host tensors: the same waits and
reads as every fetch; core/encoder.py): the rows of every segment in the arena -> an IpcPlacement (with a
hold token unless the request is a probe); else IpcUnavailable, with why (a row in host memory only, holds
full): the consumer fetches the next way. Not an error either way. Pins (cache/local.py) count the rows
delivered when the token is acknowledged, not before: a consumer whose copy failed has not had them.
`ack(tokens)` ends holds (and delivers); unknown or expired tokens are ignored.

/metrics (one collector, read at scrape): `encoder_ipc_fetches_total{outcome}` (held, probe, or why not),
`encoder_ipc_fetch_bytes_total` (bytes of rows handed out by hold), and the arena's own counters and gauges
(`encoder_ipc_arena_*`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from encoder_service.protocol.ipc import IpcPlacement, IpcRequest, IpcUnavailable, this_host

OFF, OTHER_HOST, NOT_HERE, NOT_IN_ARENA = "off", "other_host", "not_here", "not_in_arena"
OUTCOMES = ("held", "probe", OFF, OTHER_HOST, NOT_HERE, NOT_IN_ARENA)


class IpcFetches:
    """`arena`: the service's runtime/device_arena.py DeviceArena (built by api/service.py: build_core, handed
    to the engine too), or None: IPC is off here."""

    def __init__(self, arena):
        self.arena = arena
        self.host = this_host()
        self.outcomes: Counter[str] = Counter()  # OUTCOMES
        self.bytes_held = 0
        self.channel: str | None = None  # the same-host channel's socket path (api/ipc_channel.py), once it listens

    def metadata(self) -> dict | None:
        """What /v1/metadata says of IPC (None: off): a consumer asks for it only on the same host and kind."""
        a = self.arena
        if a is None:
            return None
        return {"host": self.host, "kind": a.memory.kind, "generation": a.generation, "arena_bytes": a.capacity,
                "lease_s": a.lease_s, "device": str(a.memory.device), "channel": self.channel}

    def refusal(self, request: IpcRequest) -> IpcUnavailable | None:
        """Why no fetch of this consumer's can go by IPC here (IPC off, another host), or None."""
        if self.arena is None:
            return self._unavailable(OFF, "fetch by IPC is off on this server (--ipc-arena-bytes 0, or no GPU)")
        if not request.host or request.host != self.host:
            return self._unavailable(OTHER_HOST, "the consumer is on another host (its boot id is not ours)")
        return None

    def not_here(self, public_id: str, owner: str | None) -> IpcUnavailable:
        """An id of the fetch is neither held nor encoded here: ask `owner` (its holder's address; None:
        unknown, the next way finds the rows wherever they are)."""
        where = f"ask its owner at {owner}" if owner else "its owner is not known here"
        return self._unavailable(NOT_HERE, f"id {public_id!r:.80} is not on this replica ({where})", owner)

    def answer(self, request: IpcRequest, parts: Sequence[torch.Tensor],
               delivered: Callable[[], None]) -> IpcPlacement | IpcUnavailable:
        """Where `parts` sit in the arena (held for the consumer unless a probe), or why not; `refusal` said
        None for this request already."""
        a = self.arena
        placed = a.place(parts, hold=request.hold, on_ack=delivered)
        if isinstance(placed, str):
            return self._unavailable(NOT_IN_ARENA, placed)
        offsets, token = placed
        self.outcomes["held" if request.hold else "probe"] += 1
        if request.hold:
            self.bytes_held += sum(p.numel() * p.element_size() for p in parts)
        return IpcPlacement(a.memory.kind, a.memory.handle, a.generation, a.capacity, tuple(offsets), token,
                            a.lease_s)

    def ack(self, tokens: Sequence[str]) -> int:
        """End the holds of `tokens` (their consumers' copies are done); how many were live."""
        return self.arena.release(tokens) if self.arena is not None and tokens else 0

    def _unavailable(self, outcome: str, why: str, owner: str | None = None) -> IpcUnavailable:
        self.outcomes[outcome] += 1
        return IpcUnavailable(why, owner)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()


class IpcCollector(Collector):
    """The IPC fetch's and the arena's counters, read when Prometheus scrapes."""

    def __init__(self, fetches: IpcFetches):
        self._fetches = fetches

    def collect(self) -> Iterator[Metric]:
        f = self._fetches
        outcomes = CounterMetricFamily("encoder_ipc_fetches", "Fetches by IPC, by outcome: held (the consumer "
                                       "copies GPU to GPU), probe (nothing held), or why not (off, other_host, "
                                       "not_here: answered before any wait; not_in_arena): the consumer fetched "
                                       "the next way", labels=["outcome"])
        for outcome in OUTCOMES:
            outcomes.add_metric([outcome], f.outcomes[outcome])
        yield outcomes
        yield CounterMetricFamily("encoder_ipc_fetch_bytes", "Bytes of rows handed out by IPC (held fetches)",
                                  value=f.bytes_held)
        if f.arena is None:
            return
        s = f.arena.stats()
        for key, name, help_text in (
                ("stored", "encoder_ipc_arena_stored", "Images whose rows went into the device row arena"),
                ("not_stored", "encoder_ipc_arena_not_stored", "Images whose rows did not (no room between held "
                                                               "ranges, or larger than the arena)"),
                ("acked", "encoder_ipc_arena_acks", "Holds ended by their consumer's acknowledgement"),
                ("expired", "encoder_ipc_arena_hold_expiries", "Holds ended by their lease (--ipc-lease-s)")):
            yield CounterMetricFamily(name, help_text, value=s[key])
        for key, name, help_text in (
                ("capacity_bytes", "encoder_ipc_arena_capacity_bytes", "Bytes of the device row arena"),
                ("bytes", "encoder_ipc_arena_rows_bytes", "Bytes of it holding rows fetches may place"),
                ("holds", "encoder_ipc_arena_holds", "Live hold tokens"),
                ("held_bytes", "encoder_ipc_arena_held_bytes", "Bytes held for consumers copying them")):
            yield GaugeMetricFamily(name, help_text, value=s[key])
