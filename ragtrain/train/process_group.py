"""The trainer workers' torch.distributed process group, kept off the network when Ray runs on loopback.

Ray Train rendezvous through a TCPStore on rank 0, and torch binds that store's server to the wildcard address
(`::`, every interface) whatever host it is given: the one listening socket of a local run that was not on
127.0.0.1. When the workers' node address is a loopback address (local Ray, ragtrain's default), every worker is on
this machine, so the group rendezvous through a FileStore instead, and nothing listens beyond loopback (gloo's own
sockets bind the node address). The FileStore's files go into a folder the fit makes (`rendezvous_folder`) and
removes when it ends, failed or not: a worker group that dies leaves its file behind otherwise. On a cluster (a
routable node address) Ray Train's own TCP rendezvous is used unchanged.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import ray
from ray.train._internal.utils import get_address_and_port
from ray.train.torch import TorchConfig

# Ray Train's own process-group helpers: the same set-up as its "env" init, with another rendezvous URL (private
# names; tests/train/test_process_group.py fails if they move)
from ray.train.torch.config import _set_torch_distributed_env_vars, _setup_torch_process_group, _TorchBackend


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


class _LoopbackTorchBackend(_TorchBackend):
    """Ray Train's torch backend with a FileStore rendezvous when rank 0's address is a loopback address."""

    store_file: str | None = None

    def on_start(self, worker_group, backend_config: TorchConfig) -> None:
        address, _ = worker_group.execute_single(0, get_address_and_port)
        if not is_loopback(address):
            super().on_start(worker_group, backend_config)
            return
        folder = backend_config.store_folder or tempfile.gettempdir()
        self.store_file = os.path.join(folder, f"ragtrain-pg-{uuid.uuid4().hex}")  # a restart: a new file
        worker_group.execute(_set_torch_distributed_env_vars)
        ray.get(
            [
                worker_group.execute_single_async(
                    i,
                    _setup_torch_process_group,
                    backend=backend_config.backend,
                    world_rank=i,
                    world_size=len(worker_group),
                    init_method=f"file://{self.store_file}",
                    timeout_s=backend_config.timeout_s,
                )
                for i in range(len(worker_group))
            ]
        )

    def on_shutdown(self, worker_group, backend_config) -> None:
        super().on_shutdown(worker_group, backend_config)
        if self.store_file:
            try:
                os.remove(self.store_file)
            except OSError:  # FileStore removes its file once the last client closes
                pass


@dataclass
class LoopbackTorchConfig(TorchConfig):
    """`TorchConfig` whose process group never listens beyond loopback on a local Ray (see the module docstring)."""

    store_folder: str | None = None  # where the FileStore's files go (`rendezvous_folder`); None: the temp folder

    @property
    def backend_cls(self):
        return _LoopbackTorchBackend


@contextlib.contextmanager
def rendezvous_folder() -> Iterator[str]:
    """A folder of one fit's FileStore files (`ragtrain-pg-*` in the temp folder), removed when the fit ends."""
    folder = tempfile.mkdtemp(prefix="ragtrain-pg-")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
