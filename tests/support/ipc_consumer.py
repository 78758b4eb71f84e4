"""A consumer of the fetch by IPC in a process of its own (spawned with subprocess, nothing pickled), as an LLM
server is: `python -m tests.support.ipc_consumer JOB_JSON`.

The job names the service (`url`), the fetches (`fetches`: [{"items": [[id, offset], ...], "start", "end"}]),
`device` ("cpu" with `standin_dir`: the host stand-in's reader, encoder_service/testing/host_ipc.py; "cuda:N":
the real CUDA reader) and `out_dir`. Each fetch's rows go into a fresh `out` on that device (NaN-filled, so
unwritten rows show), then to `<out_dir>/<k>.bin` as raw bytes (row-major, the rows' dtype). With
`"via": "connector"` each fetch is one image item ([[id, 0]] from 0 to its rows) loaded as vLLM's connector
does: the scheduler side's fetch and hold (integrations/vllm/fetch.py), then a worker's load (ipc_loads.py),
then the hold acknowledged as the worker reports it.
The answer, one JSON line on stdout: {"paths": the fetches by path (the connector's worker: those it made
itself), "opened": arenas the stand-in reader opened (None for CUDA), "ipc_off": why the client (the
connector: the worker) stopped trying IPC (None), "staged": per connector item, how the scheduler side left it
("ipc" or "host"), "copied": holds the connector's worker copied under}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from encoder_service.client import EncoderClient
from encoder_service.testing.host_ipc import HostStandInReader


def _save(out: torch.Tensor, path: Path) -> None:
    path.write_bytes(out.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def by_client(job: dict, device: torch.device, reader) -> dict:
    with EncoderClient.http(job["url"], timeout=60, ipc=reader) as client:
        meta = client.metadata()
        dtype, width = getattr(torch, meta["dtype"]), int(meta["row_width"])
        for k, f in enumerate(job["fetches"]):
            out = torch.full((f["end"] - f["start"], width), float("nan"), dtype=dtype, device=device)
            client.fetch([tuple(i) for i in f["items"]], f["start"], f["end"], out=out)
            _save(out, Path(job["out_dir"], f"{k}.bin"))
        return {"paths": dict(client.fetch_paths), "ipc_off": client.ipc_off}


def by_connector(job: dict, device: torch.device, reader) -> dict:
    from encoder_service.integrations.vllm.fetch import RowFetcher
    from encoder_service.integrations.vllm.ipc_loads import IpcLoader
    from encoder_service.integrations.vllm.options import ConnectorOptions
    from encoder_service.integrations.vllm.worker import IpcRows, ItemLoad, RowLoader

    options = ConnectorOptions(job["url"], shm="off", shm_dir=job["out_dir"])
    fetcher = RowFetcher(options, None, ipc_kind=reader.kind if reader != "auto" else "cuda")
    ipc = IpcLoader(options, device, reader=reader)
    loader, staged, copied = RowLoader(device, None, ipc=ipc), [], 0
    try:
        width = int(fetcher.metadata()["row_width"])
        for k, f in enumerate(job["fetches"]):
            ((item_id, _),) = f["items"]
            rows = fetcher.fetch(item_id, f["end"])
            staged.append("ipc" if isinstance(rows.ref, IpcRows) else "host")
            load = ItemLoad(item_id, f["end"], fetcher.load_ref(rows))
            _save(loader.load(load, width), Path(job["out_dir"], f"{k}.bin"))
            tokens = ipc.take_copied()
            copied += len(tokens)
            fetcher.copied(tokens)  # what the connector passes on (worker -> scheduler metadata)
            fetcher.drop(rows)
        client = ipc.client()
        return {"paths": dict(client.fetch_paths), "ipc_off": ipc.refused, "staged": staged, "copied": copied}
    finally:
        loader.close()
        fetcher.close()


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    device = torch.device(job["device"])
    reader = HostStandInReader(job["standin_dir"]) if device.type == "cpu" else "auto"
    answer = (by_connector if job.get("via") == "connector" else by_client)(job, device, reader)
    print(json.dumps(answer | {"opened": getattr(reader, "opened", None)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
