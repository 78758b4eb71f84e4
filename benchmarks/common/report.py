"""What every run leaves: the setup stamp that heads its table (date, commit, machine), its JSON, and its
other files (markdown table, profiles, logs); and, for a run whose items run in worker processes (a crash ends
only its worker), the JSON-lines record stream the workers append to and the driver reads.

The JSON is the run's record, the one RESULTS.md cites: benchmarks/results/<name>-<date>-<commit>.json
(-2, -3, ... after it when that name, date and commit already have one). With $OUT set (the GPU machine,
where only $OUT comes back) it goes to $OUT under the same name: copy it into benchmarks/results/ and commit
it with the RESULTS.md section that reports it. The other files go to $OUT, else ./bench_out.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def commit() -> str:
    """$BENCH_COMMIT, else git's short HEAD with "-dirty" when tracked files differ from it; "unknown" without
    git. Device runs must set BENCH_COMMIT: the device's copy of the tree has git metadata of another commit."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stamp() -> dict:
    """The date and commit of this run: the first entries of every setup."""
    return dict(date=datetime.date.today().isoformat(), commit=commit())


def setup_info(device: torch.device, dtype: torch.dtype, small: bool) -> dict:
    """stamp() and the machine of a model benchmark: device, dtype, torch and transformers, real or small sizes."""
    import transformers

    return stamp() | dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        dtype=str(dtype).removeprefix("torch."),
        torch=torch.__version__,
        transformers=transformers.__version__,
        sizes="small" if small else "real",
    )


def out_dir() -> Path:
    """Where a run writes its files other than the JSON: $OUT, else ./bench_out."""
    path = Path(os.environ.get("OUT") or "bench_out")
    path.mkdir(parents=True, exist_ok=True)
    return path


_paths: dict[str, Path] = {}  # name -> this run's JSON (a run may rewrite it as it goes)


def result_path(name: str, setup: dict) -> Path:
    """This run's JSON: <name>-<date>-<commit>.json in benchmarks/results/ (in $OUT when set), never another
    run's file."""
    if name not in _paths:
        folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
        folder.mkdir(parents=True, exist_ok=True)
        base = f"{name}-{setup['date']}-{setup['commit']}"
        path, n = folder / f"{base}.json", 1
        while path.exists():
            n += 1
            path = folder / f"{base}-{n}.json"
        _paths[name] = path
        print(f"{name}: results in {path}", flush=True)
    return _paths[name]


def write_result(name: str, setup: dict, body: dict, markdown: str | None = None) -> Path:
    """{"setup": setup, **body} as this run's JSON, and `markdown` as <name>.md beside the other files."""
    path = result_path(name, setup)
    path.write_text(json.dumps({"setup": setup, **body}, indent=2, default=str))
    if markdown is not None:
        (out_dir() / f"{name}.md").write_text(markdown)
    return path


def append_record(path: str, rec: dict) -> None:
    """One record at the end of the stream, on disk before this returns: the next call may crash the process."""
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str) -> list[dict]:
    """Every record of the stream (none before the first), skipping a line a kill cut short."""
    recs = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by a kill
    return recs
