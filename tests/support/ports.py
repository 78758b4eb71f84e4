"""A free TCP port on 127.0.0.1, for servers that take a port number rather than a bound socket. Stdlib only
(the engine tiers' venvs import it too)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair(offset: int, low: int = 20000, high: int = 30000) -> int:
    """A port that, with port + `offset`, was free on 127.0.0.1 a moment ago: a Redis Cluster node also listens
    on its port + 10000 (its cluster bus), which an ephemeral port (up to 60999) would push past 65535."""
    import random

    for _ in range(200):
        port = random.randrange(low, high)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port pair (port, port + {offset}) in [{low}, {high})")
