"""The one percentile of the benchmarks."""

from __future__ import annotations

import numpy as np


def percentile(samples, q: float) -> float:
    """The q-th percentile (q in [0, 100], numpy's linear interpolation) of `samples`; NaN when empty."""
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q)) if len(samples) else float("nan")
