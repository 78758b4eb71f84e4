"""The CuTe DSL's import path, shared by its optional kernels (ops/attention_fa4.py, ops/quack_gemm.py).

`cutlass` lives in nvidia_cutlass_dsl/dsl_packages, put on sys.path by a .pth file that `pip install
--target` does not run: `ensure_dsl_path()` adds it when `import cutlass` fails (a no-op without the DSL).
"""

from __future__ import annotations

import importlib
import os
import sys


def ensure_dsl_path() -> None:
    """What nvidia_cutlass_dsl's .pth does: its dsl_packages folder on sys.path (when `import cutlass` fails)."""
    try:
        import cutlass  # noqa: F401

        return
    except ImportError:
        pass
    try:
        import nvidia_cutlass_dsl
    except ImportError:
        return
    for base in list(getattr(nvidia_cutlass_dsl, "__path__", [])):
        path = os.path.join(base, "dsl_packages")
        if os.path.isdir(path) and path not in sys.path:
            sys.path.append(path)
    importlib.invalidate_caches()
