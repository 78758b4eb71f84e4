"""A free TCP port on 127.0.0.1, for servers that take a port number rather than a bound socket. Stdlib only
(the engine tiers' venvs import it too)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
