"""The CuTe DSL's optional kernel packages (ops/attention_fa4.py: FlashAttention-4, ops/quack_gemm.py: quack):
their import path, and one import of each, tried on first use and remembered.

`cutlass` lives in nvidia_cutlass_dsl/dsl_packages, put on sys.path by a .pth file that `pip install
--target` does not run: `ensure_dsl_path()` adds it when `import cutlass` fails (a no-op without the DSL).
`DslImport`: a package's entry points imported once (after `ensure_dsl_path`), never at import of its
module, or why they could not be; `available(device)` says whether they run on a device (CUDA, its compute
capability, then the import).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


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


class DslImport(Generic[T]):
    """`load()`'s result (the package's entry points), imported on the first `get`, or why it failed: any
    exception (ImportError, OSError for a missing .so, a version check, quack's epilogue fingerprint) means
    "not usable here", kept as "import <module> failed: <type>: <message, cut at reason_chars>"."""

    def __init__(self, module: str, load: Callable[[], T], *, majors: tuple[int, ...], arch_note: str,
                 reason_chars: int = 300):
        self.module, self._load, self._majors, self._arch_note = module, load, majors, arch_note
        self._reason_chars = reason_chars
        self._loaded: tuple[T | None, str] | None = None  # None: not tried yet

    def get(self) -> tuple[T | None, str]:
        """(entry points, '') after a successful import, (None, why not) after a failed one."""
        if self._loaded is None:
            try:
                ensure_dsl_path()
                self._loaded = (self._load(), "")
            except Exception as e:  # noqa: BLE001 - see the class docstring
                self._loaded = (None, f"import {self.module} failed: {type(e).__name__}: "
                                      f"{str(e)[:self._reason_chars]}")
        return self._loaded

    def require(self) -> T:
        """The entry points; RuntimeError saying why where the package does not import."""
        loaded, why = self.get()
        if loaded is None:
            raise RuntimeError(why)
        return loaded

    def available(self, device: torch.device) -> tuple[bool, str]:
        """(usable, why not): a CUDA device of one of `majors`, then the import (tried at the first such call)."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return False, "needs a CUDA device"
        major, minor = torch.cuda.get_device_capability(device)
        if major not in self._majors:
            return False, f"sm{major}{minor}: {self._arch_note}"
        loaded, why = self.get()
        return loaded is not None, why
