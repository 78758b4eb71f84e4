"""The kernel policy in force on a thread, for the ops that choose among backends (attention.py,
mlp_kernels.py): the one `use` made active around a forward or a graph capture (a captured graph keeps the
kernels it recorded), else one default, made on first use."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

P = TypeVar("P")


class ThreadPolicy(Generic[P]):
    def __init__(self, make_default: Callable[[], P]):
        self._make_default, self._default, self._local = make_default, None, threading.local()

    def active(self) -> P:
        policy = getattr(self._local, "policy", None)
        if policy is not None:
            return policy
        if self._default is None:
            self._default = self._make_default()
        return self._default

    @contextlib.contextmanager
    def use(self, policy: P) -> Iterator[P]:
        previous = getattr(self._local, "policy", None)
        self._local.policy = policy
        try:
            yield policy
        finally:
            self._local.policy = previous
