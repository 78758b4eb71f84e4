"""A consumer of the fetch by IPC in a process of its own (spawned with subprocess, nothing pickled), as an LLM
server is: `python -m tests.support.ipc_consumer JOB_JSON`.

The job names the service (`url`), the fetches (`fetches`: [{"items": [[id, offset], ...], "start", "end"}]),
`device` ("cpu" with `standin_dir`: the host stand-in's reader, encoder_service/testing/host_ipc.py; "cuda:N":
the real CUDA reader) and `out_dir`. Each fetch's rows go into a fresh `out` on that device (NaN-filled, so
unwritten rows show), then to `<out_dir>/<k>.bin` as raw bytes (row-major, the rows' dtype); the answer, one
JSON line on stdout: {"paths": the client's fetch_paths, "opened": arenas the reader opened (stand-in only)}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from encoder_service.client import EncoderClient
from encoder_service.testing.host_ipc import HostStandInReader


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    device = torch.device(job["device"])
    reader = HostStandInReader(job["standin_dir"]) if device.type == "cpu" else "auto"
    with EncoderClient.http(job["url"], timeout=60, ipc=reader) as client:
        meta = client.metadata()
        dtype, width = getattr(torch, meta["dtype"]), int(meta["row_width"])
        for k, f in enumerate(job["fetches"]):
            out = torch.full((f["end"] - f["start"], width), float("nan"), dtype=dtype, device=device)
            client.fetch([tuple(i) for i in f["items"]], f["start"], f["end"], out=out)
            Path(job["out_dir"], f"{k}.bin").write_bytes(out.cpu().view(-1).view(torch.uint8).numpy().tobytes())
        paths = dict(client.fetch_paths)
    print(json.dumps({"paths": paths, "opened": getattr(reader, "opened", None)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
