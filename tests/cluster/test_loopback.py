"""Local mode listens on loopback only: every TCP listener of every process of the cluster."""

import ipaddress

from cluster.local import cluster_processes, running_state
from cluster.loopback import loopback_address
from helpers import LOOPBACK_IPS, tcp_listeners


def test_every_listener_of_the_cluster_is_on_loopback(local_cluster):
    state = running_state(local_cluster.settings)
    assert state is not None
    processes = cluster_processes(local_cluster.settings, state.pid)
    listeners = tcp_listeners(processes)
    ports = {port for _ip, port, _name in listeners}
    # The check sees the whole cluster: the API and dashboard ports are among the listeners it inspected.
    assert {local_cluster.http_port, local_cluster.dashboard_port} <= ports
    # The API port is the replica's own (direct ingress): no proxy process stands between clients and the API.
    api = [name for _ip, port, name in listeners if port == local_cluster.http_port]
    assert api and all(name.startswith("ray::ServeReplica") for name in api), listeners
    exposed = [(ip, port, name) for ip, port, name in listeners if ip not in LOOPBACK_IPS]
    assert exposed == []
    assert all(ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback for ip, _port, _name in listeners)


def test_replica_grpc_address_is_rewritten_to_loopback():
    assert loopback_address("[::]:0") == "127.0.0.1:0"
    assert loopback_address("[::]:9000") == "127.0.0.1:9000"
    assert loopback_address("10.0.0.5:9000") == "10.0.0.5:9000"
