"""One checked backend chain: how an op that has several kernels picks one per key, the shape of both of ops'
kernel choices (attention.py: per layout class, head dim and dtype; mlp_kernels.py: per MLP form, device,
dtype and widths).

A `BackendChain` subclass says, per key, the backends in the order they are tried (`chain(key)`; the last
one is the fallback, always there and never checked), whether a backend can serve a key (`usable`: Python
ints only) and how a key reads in the log and in describe(). On that, the chain:

  - validates the choice (the subclass's CHOICES) at construction;
  - says what is present: `why_absent(requirement, probe)`, faked by `available` (tests, benchmarks);
  - picks per key the first usable backend not demoted for it: `pick` (no check: cheap enough for every
    call) or `pick_checked` (each candidate checked once per key and check id, one that fails demoted and
    the next one checked); what it picked is remembered (`picked`) until a demotion for that key;
  - demotes with a reason (logged on the subclass's logger, kept for describe()); the fallback cannot be
    demoted: nothing is left after it;
  - describes: the choice, the backend per key, the demotions.

`check_against_float32` is the check both ops run: the backend eagerly, then (capture=True) captured in a
CUDA graph (ops/cuda_graph.py, as the runner's graphs are) and replayed on new inputs with its output poisoned
with NaN first, each time compared with the float32 reference. `ThreadPolicy`: the chain in force on a thread
(a runner's, around its forward and captures: a captured graph keeps the kernels it recorded), else one
default made on first use.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import ClassVar, Generic, TypeVar

import torch

from encoder_service.ops.cuda_graph import capturing

K = TypeVar("K", bound=tuple)
P = TypeVar("P")


class BackendChain(Generic[K]):
    """Which backend serves each key, for one choice; see the module docstring. Subclasses set CHOICES,
    `kind` (the choice's name in errors), `log` and the hooks below."""

    CHOICES: ClassVar[tuple[str, ...]]
    kind: ClassVar[str]
    log: ClassVar[logging.Logger]

    def __init__(self, choice: str = "auto", *, available: Mapping[str, bool | str] | None = None):
        if choice not in self.CHOICES:
            raise ValueError(f"{self.kind} choice must be one of {', '.join(self.CHOICES)}, got {choice!r}")
        self.choice = choice
        # requirement -> '' (present) or why not; `available` fakes the probes (True: present, str: reason)
        self._present: dict[str, str] = {
            name: "" if ok is True else (str(ok) if ok else "unavailable") for name, ok in (available or {}).items()
        }
        self._selected: dict[K, str] = {}  # key -> backend
        self._demoted: dict[tuple[str, K], str] = {}  # (backend, key) -> why
        self._checked: set[tuple[str, K, Hashable]] = set()  # (backend, key, check id) that passed
        self._lock = threading.Lock()  # one checking walk at a time (the default policy is shared by threads)

    # -- what a subclass says -------------------------------------------------------------------------

    def chain(self, key: K) -> tuple[str, ...]:
        """The backends tried for `key` under this choice, in order; the last is the fallback."""
        raise NotImplementedError

    def usable(self, name: str, key: K, device: torch.device) -> bool:
        """Whether `name` can serve `key` on `device` at all (present, serves its shapes)."""
        return True

    def label(self, key: K) -> str:
        raise NotImplementedError

    def demoted_label(self, name: str, key: K) -> str:
        return f"{name}@{self.label(key)}"

    def demotion_note(self, name: str, key: K) -> str:
        """The log line of a demotion, before its reason."""
        raise NotImplementedError

    # -- what is present ------------------------------------------------------------------------------

    def why_absent(self, requirement: str, probe: Callable[[], str], *, remember: bool = True) -> str:
        """'' if `requirement` is here, else why not: faked by `available`, else `probe()` (remembered unless
        the answer depends on more than the requirement's name)."""
        if requirement in self._present:
            return self._present[requirement]
        why = probe()
        if remember:
            self._present[requirement] = why
        return why

    def absences(self) -> dict[str, str]:
        return {requirement: why for requirement, why in self._present.items() if why}

    # -- the walk -------------------------------------------------------------------------------------

    def picked(self, key: K) -> str | None:
        return self._selected.get(key)

    def pick(self, key: K, device: torch.device) -> str:
        """The first usable backend of key's chain not demoted for it (unchecked), remembered."""
        name = self._selected.get(key)
        if name is None:
            name = self._selected[key] = self._first_usable(key, device)
        return name

    def pick_checked(self, key: K, device: torch.device, check: Callable[[str], str | None],
                     check_id: Hashable = ()) -> str:
        """The first usable backend of key's chain that passes `check(name)` (falsy: passed, else why not),
        each checked once per (key, check_id); one that fails is demoted for `key` and the next one checked.
        The fallback runs unchecked."""
        with self._lock:
            while True:
                name = self._first_usable(key, device)
                if name != self.chain(key)[-1] and (name, key, check_id) not in self._checked:
                    why = check(name)
                    if why:
                        self.demote(name, key, why)
                        continue
                    self._checked.add((name, key, check_id))
                self._selected[key] = name
                return name

    def demote(self, name: str, key: K, why: str) -> None:
        """`name` no longer serves `key` (logged); the key's next pick walks on from it."""
        if name == self.chain(key)[-1]:
            raise RuntimeError(f"{name} failed: {why}")
        self.log.warning("%s: %s", self.demotion_note(name, key), why)
        self._demoted[(name, key)] = why
        if self._selected.get(key) == name:
            del self._selected[key]

    def _first_usable(self, key: K, device: torch.device) -> str:
        names = self.chain(key)
        return next((b for b in names[:-1] if (b, key) not in self._demoted and self.usable(b, key, device)),
                    names[-1])

    # -- what ran -------------------------------------------------------------------------------------

    def selected(self) -> dict[str, str]:
        """label -> backend for every key picked so far (after a runner's warm-up or capture: what its forward
        runs)."""
        return {self.label(key): name for key, name in sorted(self._selected.items(), key=lambda kv: str(kv[0]))}

    def demotions(self) -> dict[str, str]:
        return {self.demoted_label(name, key): why for (name, key), why in self._demoted.items()}

    def describe(self) -> dict:
        return {"choice": self.choice, "selected": self.selected(), "demoted": self.demotions()}


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: how keys read in labels and log lines."""
    return str(dtype).removeprefix("torch.")


# ---- the check against float32 ----------------------------------------------------------------------

# make_inputs() -> (call, reference, refill): call() runs the backend on static input buffers and returns its
# output; reference() is the float32 output for the buffers' current values; refill() writes new values into
# the same buffers (between capture and replay).
CheckInputs = tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], Callable[[], None]]


def check_against_float32(make_inputs: Callable[[], CheckInputs], compare: Callable[[torch.Tensor, torch.Tensor], str],
                          device, *, capture: bool) -> str:
    """'' if the backend's output matches the reference (`compare`: '' or why not) eagerly and, with capture,
    replayed in a CUDA graph on refilled inputs (its output poisoned with NaN first, so an unwritten element
    fails), else what went wrong: a mismatch, or any exception but running out of memory."""
    try:
        call, reference, refill = make_inputs()
        why = compare(call(), reference())
        if why or not capture:
            return why
        stream = torch.cuda.Stream(device)  # warm-up off the capture: compiles, picks algorithms
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):  # as the runner's graphs are captured
            out = call()
        refill()
        out.fill_(float("nan"))
        graph.replay()
        why = compare(out, reference())
        del graph
        return f"in a CUDA graph: {why}" if why else ""
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure (import, JIT compile, launch) demotes the backend
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
        return f"{type(e).__name__}: {str(e)[:300]}"


def nan_rows(out: torch.Tensor) -> str:
    """'' or how many rows (first dim) hold a NaN."""
    bad = int(out.isnan().flatten(1).any(1).sum())
    return f"{bad} rows with NaN" if bad else ""


def nan_elements(out: torch.Tensor) -> str:
    bad = int(out.isnan().sum())
    return f"{bad} elements NaN (unwritten or overflowed)" if bad else ""


def relative_error(out: torch.Tensor, ref: torch.Tensor, rel_tol: float, nans: Callable[[torch.Tensor], str]) -> str:
    """'' if out (any dtype) is within `rel_tol` of the float32 `ref` in L2 norm, with no NaN (`nans` says
    how they are counted), else why not."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o = out.float()
    why = nans(o)
    if why:
        return why
    rel = float((o - ref).norm() / ref.norm().clamp_min(1e-30))
    return "" if rel <= rel_tol else f"relative error {rel:.2e} > {rel_tol:g} against float32"


# ---- the chain in force on a thread ------------------------------------------------------------------


class ThreadPolicy(Generic[P]):
    """The policy `use` made active on this thread, else one default (made on first use)."""

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
