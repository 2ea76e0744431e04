"""Serve's inter-deployment gRPC server on tpserve's own local cluster: the launcher asks for
loopback only without --address, and the override in serve/loopback.py binds loopback where
Ray bound every interface, passes everything else through, and leaves Ray's bind whenever
something is not as expected (no Ray cluster needed). The launched cluster is checked in
test_serve_e2e.py::test_replicas_listen_on_loopback_only."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import ray
from ray.serve._private import replica as serve_replica
from server_process import listening_sockets

from tpserve.serve import loopback


class Binds:
    """Stands for Ray's add_port_to_grpc_server: records each address, fails on `refuse`."""

    def __init__(self, refuse: str | None = None, answer: int = 4242):
        self.addresses: list[str] = []
        self.refuse, self.answer = refuse, answer

    def __call__(self, server, address: str) -> int:
        self.addresses.append(address)
        if address == self.refuse:
            raise RuntimeError(f"Failed to bind to address {address}")
        return self.answer


@pytest.fixture
def ray_bind(monkeypatch):
    """Ray's bind replaced by a recorder, on a node whose address is 127.0.0.1."""
    binds = Binds()
    monkeypatch.setattr(serve_replica, "add_port_to_grpc_server", binds)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    return binds


def test_rays_any_address_becomes_the_nodes_loopback_address(ray_bind):
    assert loopback.keep_replica_grpc_on_loopback()
    assert serve_replica.add_port_to_grpc_server(None, "[::]:0") == 4242
    assert ray_bind.addresses == ["127.0.0.1:0"]
    # Any other address is Ray's own choice, not the one this was written for: unchanged.
    serve_replica.add_port_to_grpc_server(None, "[::]:9000")
    assert ray_bind.addresses[-1] == "[::]:9000"
    # Called again in the same process (ingress and replica code both call it): not wrapped
    # twice.
    wrapped = serve_replica.add_port_to_grpc_server
    assert loopback.keep_replica_grpc_on_loopback()
    assert serve_replica.add_port_to_grpc_server is wrapped


def test_ipv6_loopback_node_gets_brackets(ray_bind, monkeypatch):
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "::1")
    assert loopback.keep_replica_grpc_on_loopback()
    serve_replica.add_port_to_grpc_server(None, "[::]:0")
    assert ray_bind.addresses == ["[::1]:0"]


@pytest.mark.parametrize("node", ["10.1.2.3", "node-1.example"])
def test_node_reached_from_other_machines_keeps_rays_bind(ray_bind, monkeypatch, caplog, node):
    """Handles connect to the node's address: binding loopback there would cut them off."""
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: node)
    with caplog.at_level(logging.WARNING, logger=loopback.__name__):
        assert not loopback.keep_replica_grpc_on_loopback()
    assert serve_replica.add_port_to_grpc_server is ray_bind
    assert [r.getMessage() for r in caplog.records] == [
        f"this node's address {node} is not loopback: Serve's inter-deployment gRPC server "
        "keeps Ray's address (every interface)"]


def test_a_failed_loopback_bind_falls_back_to_rays_address(monkeypatch, caplog):
    binds = Binds(refuse="127.0.0.1:0")
    monkeypatch.setattr(serve_replica, "add_port_to_grpc_server", binds)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    assert loopback.keep_replica_grpc_on_loopback()
    with caplog.at_level(logging.WARNING, logger=loopback.__name__):
        assert serve_replica.add_port_to_grpc_server(None, "[::]:0") == 4242
    assert binds.addresses == ["127.0.0.1:0", "[::]:0"]
    assert "could not bind" in caplog.text and "Failed to bind" in caplog.text
    # gRPC versions that answer port 0 instead of raising: the same fallback.
    binds = Binds(answer=0)
    monkeypatch.setattr(serve_replica, "add_port_to_grpc_server", binds)
    assert loopback.keep_replica_grpc_on_loopback()
    serve_replica.add_port_to_grpc_server(None, "[::]:0")
    assert binds.addresses == ["127.0.0.1:0", "[::]:0"]


def test_a_changed_ray_is_left_alone_with_one_warning(monkeypatch, caplog):
    monkeypatch.delattr(serve_replica, "add_port_to_grpc_server")
    with caplog.at_level(logging.WARNING, logger=loopback.__name__):
        assert not loopback.keep_replica_grpc_on_loopback()
    assert not hasattr(serve_replica, "add_port_to_grpc_server")
    assert len(caplog.records) == 1 and "replica module changed" in caplog.text


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc")
def test_a_real_grpc_server_listens_on_loopback_through_rays_own_helper(monkeypatch):
    """Ray's own add_port_to_grpc_server (TLS-aware), through the override, on a real gRPC
    server: the listening socket is loopback; without the override it is every interface."""
    import grpc

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    rays = serve_replica.add_port_to_grpc_server
    servers = []

    def listen() -> tuple[str, int]:
        server = grpc.server(ThreadPoolExecutor(1))
        servers.append(server)
        port = serve_replica.add_port_to_grpc_server(server, "[::]:0")
        server.start()
        return next((a, p) for a, p, _ in listening_sockets([os.getpid()]) if p == port)

    try:
        assert listen()[0] == "::"  # Ray's bind, as the replica does it
        assert loopback.keep_replica_grpc_on_loopback()
        assert serve_replica.add_port_to_grpc_server is not rays
        assert listen()[0] == "127.0.0.1"
    finally:
        for server in servers:
            server.stop(None)


def test_launcher_asks_for_it_only_on_the_cluster_it_starts(monkeypatch):
    """No --address: tpserve's own loopback cluster, so both deployments (the ingress and
    the replicas) are built asking for it; with --address, a cluster of several machines
    whose handles come from elsewhere, neither is."""
    from test_serve_cli import config, parse

    from tpserve import cli
    from tpserve.serve import app

    specs = []

    def run(cfg, spec, *a, **kw):
        specs.append(spec)
        raise RuntimeError("stop here")

    monkeypatch.setattr(cli, "_start_ray", lambda *a, **kw: None)
    monkeypatch.setattr(app, "run", run)
    monkeypatch.setattr(app, "shutdown", lambda: None)
    # No cluster is started here: the fit check (tests/test_placement.py) would read
    # whatever Ray an earlier test left connected.
    monkeypatch.setattr(app, "check_replicas_fit", lambda *a, **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda **kw: None)
    for argv, wanted in ((["--replicas", "2"], True),
                         (["--replicas", "2", "--address", "auto"], False)):
        server = SimpleNamespace(ssl_certfile=None)
        assert cli.launch_replicas(parse(*argv), config(2, "cpu"), server) == 1
        assert specs[-1].grpc_on_loopback is wanted, argv
        ingress = app.build_application(config(2, "cpu"), specs[-1])._bound_deployment
        replica = ingress.init_args[0]._bound_deployment
        assert ingress.init_kwargs == {"grpc_on_loopback": wanted,
                                       "model_path": config(2, "cpu").model.path}
        assert replica.init_kwargs == {"grpc_on_loopback": wanted}
