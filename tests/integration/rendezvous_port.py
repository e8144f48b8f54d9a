"""A port for a run's rendezvous store (standard library only: the warm ranks server imports it as a script's
neighbour, the launcher as a test module).

Free now and below Linux's ephemeral range (32768 and up): a port the kernel hands out for ``bind(0)`` can be taken
by another process's outgoing connection (gloo's) before the store listens on it (seen once as EADDRINUSE in a full
run)."""

from __future__ import annotations

import random
import socket


def rendezvous_port() -> int:
    for port in random.sample(range(20000, 32000), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999 for the rendezvous store")
