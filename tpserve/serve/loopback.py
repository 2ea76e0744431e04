"""Keeps a Serve replica's inter-deployment gRPC server on loopback, on the local cluster that
`tpserve launch` starts for itself (docs/reliability.md, "What `tpserve launch` opens").

Every Serve replica (the ingress and each tp group) starts a gRPC server for handle calls made
over gRPC. Ray 2.60 binds it to every interface, `add_port_to_grpc_server(self._server,
"[::]:0")` in ray/serve/_private/replica.py (Replica._on_initialized), with no setting for the
address. A handle reaches it at the replica's node IP (RunningReplica.stub in
ray/serve/_private/request_router/replica_wrapper.py), which on tpserve's local cluster is
127.0.0.1, so binding it there keeps those calls working; by default Serve's handles make actor
calls and do not use it at all (RAY_SERVE_USE_GRPC_BY_DEFAULT=1 turns it on).

This replaces that one name in Serve's replica module, in the replica's own process, before
Serve starts the server (it does so after the deployment's constructor returns). Anything
unexpected leaves Ray's bind as it is, with one warning.
"""

from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger(__name__)

RAY_BIND = "[::]:0"  # the address Ray 2.60's replica asks for; any other passes through


def _is_loopback(node: str) -> bool:
    try:
        return ipaddress.ip_address(node).is_loopback
    except ValueError:  # a host name: not one this was written for
        return False


def keep_replica_grpc_on_loopback() -> bool:
    """Call from a Serve deployment's constructor on tpserve's own local cluster only; whether
    the server will bind to this node's loopback address."""
    try:
        import ray
        from ray.serve._private import replica as serve_replica

        node = ray.util.get_node_ip_address()
        original = serve_replica.add_port_to_grpc_server
    except Exception as exc:  # noqa: BLE001 - Ray moved things: keep its behaviour
        log.warning("Ray Serve's replica module changed (%s): its inter-deployment gRPC "
                    "server keeps Ray's address (every interface)", exc)
        return False
    if getattr(original, "tpserve_loopback", False):  # already done in this process
        return True
    if not _is_loopback(node):
        # Handles connect to the node's address: loopback would cut them off.
        log.warning("this node's address %s is not loopback: Serve's inter-deployment gRPC "
                    "server keeps Ray's address (every interface)", node)
        return False
    local = f"[{node}]:0" if ":" in node else f"{node}:0"

    def add_port(server, address):
        if address != RAY_BIND:
            return original(server, address)
        try:
            port = original(server, local)
        except Exception as exc:  # noqa: BLE001 - never stop the replica from serving
            port, why = 0, exc
        else:
            why = "no port"
        if port:
            return port
        log.warning("could not bind Serve's inter-deployment gRPC server to %s (%s): it "
                    "listens on Ray's %s", local, why, address)
        return original(server, address)

    add_port.tpserve_loopback = True
    serve_replica.add_port_to_grpc_server = add_port
    return True
