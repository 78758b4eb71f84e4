"""A stand-in for a Kubernetes Service in front of replicas: a TCP forwarder on loopback that sends each new
connection to the next of its backends in turn (kube-proxy without session affinity), counting them. With
`rate` (bytes per second, each direction of each connection) it is a slow link: over any span of t seconds
at most rate * t + one piece of rate / 10 bytes cross."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter

CHUNK = 1 << 16


class Forwarder:
    def __init__(self, backends: list[tuple[str, int]], rate: float | None = None):
        self.backends, self.rate = backends, rate
        self.connections: Counter[tuple[str, int]] = Counter()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._next = 0
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="forwarder", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            backend = self.backends[self._next % len(self.backends)]
            self._next += 1
            self.connections[backend] += 1
            try:
                upstream = socket.create_connection(backend, timeout=10)
            except OSError:
                client.close()
                continue
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(src, dst, self.rate), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _pipe(src: socket.socket, dst: socket.socket, rate: float | None) -> None:
    """Bytes from src to dst until src ends (then dst's sending side is shut: the peer sees the end); with
    `rate`, each piece is followed by the time it takes at that rate."""
    piece = CHUNK if rate is None else max(1, min(CHUNK, int(rate / 10)))
    try:
        while data := src.recv(piece):
            dst.sendall(data)
            if rate is not None:
                time.sleep(len(data) / rate)
    except OSError:
        pass
    finally:
        for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass
