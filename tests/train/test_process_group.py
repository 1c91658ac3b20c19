"""The trainer workers' process group on a local Ray: nothing listens beyond loopback."""

from __future__ import annotations

import ipaddress
import json

from ragtrain.train.process_group import LoopbackTorchConfig, _LoopbackTorchBackend, is_loopback


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 too


def test_every_socket_of_a_training_run_listens_on_loopback(quickstart_run) -> None:
    """Sampled while the shared quickstart ran (2 gloo Train workers, the index actors, MLflow): Ray Train's TCPStore
    bound the wildcard address (`::`) on rank 0 before."""
    _, _, tmp = quickstart_run
    seen = [tuple(x) for x in json.loads((tmp / "listening.json").read_text())]
    assert any(name.startswith("ray::") for _, name in seen), seen  # the sampler saw Ray's workers
    wide = [(ip, name) for ip, name in seen if not _loopback(ip)]
    assert not wide, f"listening beyond loopback: {wide}"


def test_loopback_addresses_pick_the_file_rendezvous() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.7") and not is_loopback("node-1.cluster")
    assert LoopbackTorchConfig(backend="gloo").backend_cls is _LoopbackTorchBackend
