"""An address on loopback that never answers, as a frozen process, a hung one or a filtered port looks from the
outside (no iptables needed):

  - `Blackhole("silent")`: a listening socket that never accepts: a connect succeeds (the kernel completes it
    into the backlog) and the request is taken, but no byte ever comes back (a SIGSTOPped server looks so);
  - `Blackhole("dropping")`: a listening socket whose backlog (one connection) is already full: the kernel
    drops every SYN, so a connect never completes (a port whose packets are dropped).

`.url` is http://127.0.0.1:<port>; `close()` (or the context manager) frees it.
"""

from __future__ import annotations

import socket


class Blackhole:
    def __init__(self, kind: str = "silent"):
        if kind not in ("silent", "dropping"):
            raise ValueError(kind)
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=64 if kind == "silent" else 0)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._held = []
        if kind == "dropping":  # fill the one-connection backlog ourselves
            self._held.append(socket.create_connection(self._listener.getsockname(), timeout=5))

    def close(self) -> None:
        for sock in self._held:
            sock.close()
        self._listener.close()

    def __enter__(self) -> Blackhole:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
