"""The API replica's own HTTP socket (Serve's direct ingress) reuses its address, as every HTTP server's does.

With direct ingress (``cluster.local.serve_env``) the replica binds lilo's port itself. Ray Serve 2.60 creates that
socket without ``SO_REUSEADDR`` (``ray.serve._private.http_util.start_asgi_http_server``), so every connection the
server closed first (idle keep-alives, the stop) leaves the port in TIME_WAIT for a minute, during which nothing
can bind it again: `lilo up` right after `lilo down` found the port taken, and a restarted replica failed to
bind, after which Serve blocks the port for good. Called in the replica before Serve starts that server; only the
sockets of that module change.
"""

from __future__ import annotations

import socket
from types import ModuleType
from typing import Any


class _ReusableSockets(ModuleType):
    """Stands in for the ``socket`` module inside Serve's ``http_util``: sockets it makes reuse their address."""

    def __init__(self) -> None:
        super().__init__("socket")

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)

    @staticmethod
    def socket(*args: Any, **kwargs: Any) -> socket.socket:
        sock = socket.socket(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock


def reuse_listening_address() -> None:
    from ray.serve._private import http_util

    if not isinstance(http_util.socket, _ReusableSockets):
        http_util.socket = _ReusableSockets()
