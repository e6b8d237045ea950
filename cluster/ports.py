"""Free loopback ports for the lilo clusters one process starts on this machine (the tests, the benchmarks).

Two probes that each bind port 0 and close can get one port back, and any process's next bind to port 0 (Ray's
own servers bind theirs that way) may take a port handed out a moment ago. So ``free_ports`` draws from below
the kernel's ephemeral range, which port 0 and outgoing connections draw from (Linux's default is 32768-60999),
and above Ray's worker ports (10002-19999); it holds every port it chose bound until all are chosen; and one
process never hands out a port twice.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading

PORT_RANGE = range(20000, 32768)

_handed_out: set[int] = set()
_lock = threading.Lock()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free on ``host`` now and that this process never handed out before."""
    with _lock, contextlib.ExitStack() as held:
        chosen: list[int] = []
        # In random order, so that processes choosing at the same moment (parallel test runs) rarely try the same.
        for port in random.sample(PORT_RANGE, len(PORT_RANGE)):
            if port in _handed_out:
                continue
            probe = held.enter_context(socket.socket())
            try:
                probe.bind((host, port))
            except OSError:
                continue
            chosen.append(port)
            if len(chosen) == count:
                _handed_out.update(chosen)
                return chosen
    raise RuntimeError(f"Fewer than {count} free ports are left in {PORT_RANGE.start}-{PORT_RANGE.stop - 1}.")
