"""The one percentile of the benchmarks, and a process's resident memory."""

from __future__ import annotations

import numpy as np


def percentile(samples, q: float) -> float:
    """The q-th percentile (q in [0, 100], numpy's linear interpolation) of `samples`; NaN when empty."""
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q)) if len(samples) else float("nan")


def rss_mib(pid: int | str = "self") -> float:
    """Resident memory of process `pid` (Linux /proc), MiB; NaN when it does not say."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")
