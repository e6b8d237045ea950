"""Keep Serve replicas off the network in local mode.

Ray Serve 2.60 starts an inter-deployment gRPC server in every replica on the hard-coded address ``[::]:0``
(``ray.serve._private.replica``), i.e. on every interface, even when Ray itself is loopback-only. lilo never
uses that server across machines in local mode (handles go through Ray actor calls), so in local mode each
worker rewrites that one address to loopback before the replica code loads. Applied through the job-level
``worker_process_setup_hook`` of the private head's driver (``cluster.worker_setup``), so only in local mode.
"""

from __future__ import annotations

import logging
import sys

from ray._common import tls_utils

logger = logging.getLogger(__name__)

ALL_INTERFACES_PREFIX = "[::]:"
LOOPBACK_PREFIX = "127.0.0.1:"


def loopback_address(address: str) -> str:
    """``[::]:<port>`` -> ``127.0.0.1:<port>``; any other address is left as it is."""
    if address.startswith(ALL_INTERFACES_PREFIX):
        return LOOPBACK_PREFIX + address[len(ALL_INTERFACES_PREFIX):]
    return address


def bind_replica_grpc_to_loopback() -> None:
    """Ray worker setup hook: make the replica's internal gRPC server listen on 127.0.0.1 only."""
    original = tls_utils.add_port_to_grpc_server
    if getattr(original, "lilo_loopback", False):
        return

    def add_port_on_loopback(server, address: str) -> int:
        return original(server, loopback_address(address))

    add_port_on_loopback.lilo_loopback = True
    tls_utils.add_port_to_grpc_server = add_port_on_loopback
    # The replica module imports the function by name; patch its reference too if it is already loaded.
    replica_module = sys.modules.get("ray.serve._private.replica")
    if replica_module is not None:
        replica_module.add_port_to_grpc_server = add_port_on_loopback
    logger.debug("Serve replica gRPC server bound to loopback")
