"""On a cluster of several nodes, every path the run shares must be visible from every node: checked up front.

Ray Data read tasks open the passage store, encode actors write vector files, the index is built from them in a
Ray task, Ray Train workers checkpoint and rank 0 logs to a SQLite store, all by path. Without a filesystem that
every node mounts, each of these fails in its own way, late, naming a file that exists on the driver. So before any
work a tiny task pinned to each alive node looks for what the driver wrote or read, and a missing path is one line
naming its config key and the node.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from ragtrain.config.logger import LoggerBackend
from ragtrain.runtime.errors import ConfigError
from ragtrain.track.mlflow import store_folder, tracking_uri

__all__ = ["PROBE_TIMEOUT_S", "check_shared_paths", "shared_paths"]

PROBE_TIMEOUT_S = 120.0  # one 0-CPU task per node; a node that cannot run one in this time is not usable anyway


def shared_paths(cfg: Any, out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({config key: folder the run writes}, {config key: path the run reads}) that every node must see."""
    written = {"output_dir": str(out)}
    if cfg.index.cache_dir:
        written["index.cache_dir"] = cfg.index.cache_dir

    if LoggerBackend(cfg.logger.backend) == LoggerBackend.mlflow:  # rank 0 logs into the store from its own node
        folder = store_folder(tracking_uri(cfg.logger))
        if folder is not None:  # a SQLite or file store (a server needs no shared disk)
            written["logger.tracking_uri"] = str(folder)
    read = {}
    if cfg.data.root and not cfg.data.generate:
        read["data.root"] = cfg.data.root
    if cfg.retriever.teacher.path:
        read["retriever.teacher.path"] = cfg.retriever.teacher.path
    g = cfg.generator
    for key, value in (
        ("retriever.model", cfg.retriever.model),
        ("generator.model", g.model),
        ("generator.tokenizer", g.tokenizer or ""),
        ("generator.retrieval.index_dir", g.retrieval.index_dir or ""),
    ):
        if os.path.isabs(value):  # a local folder (the config made it absolute); hub names are not paths
            read[key] = value
    return written, read


def _look(paths: list[str]) -> tuple[str, list[bool]]:
    """On one node: its id and whether each path exists there."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    return ray.get_runtime_context().get_node_id(), [os.path.exists(p) for p in paths]


def check_shared_paths(
    written: dict[str, str],
    read: dict[str, str],
    timeout_s: float = PROBE_TIMEOUT_S,
    nodes: list[dict] | None = None,
) -> list[str]:
    """ConfigError naming the key and the node when a path is not visible from every alive node; returns the ids
    of the nodes that looked (a single node: none, nothing to check). `written` folders get a probe file (removed
    after)."""
    # lazy: ray is heavy (~0.5 s); this module imports without it
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in (ray.nodes() if nodes is None else nodes) if n.get("Alive")]
    if len(nodes) < 2:
        return []
    probes: dict[str, str] = {}
    try:
        for key, folder in written.items():
            place = Path(folder)
            while not place.exists() and place != place.parent:
                place = place.parent  # a store's folder made later: its nearest existing parent is what must be shared
            probe = place / f".ragtrain-probe-{uuid.uuid4().hex[:12]}"
            probe.write_text("")
            probes[key] = str(probe)
        keys = list(probes) + list(read)
        paths = [probes[k] for k in probes] + [read[k] for k in read]
        look = ray.remote(num_cpus=0)(_look)
        refs = [
            look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(paths)
            for n in nodes
        ]
        where = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in nodes}
        answers = ray.get(refs, timeout=timeout_s)
        for node_id, seen in answers:
            for key, ok in zip(keys, seen):
                if not ok:
                    shown = written.get(key) or read[key]
                    raise ConfigError(
                        f"{key}={shown!r} is not visible from node {node_id[:12]} ({where.get(node_id, '?')}): on a "
                        f"cluster of {len(nodes)} nodes it must be on a filesystem every node mounts (NFS, EFS, a "
                        "ReadWriteMany volume; docs/cluster.md)"
                    )
    finally:
        for probe_file in probes.values():
            Path(probe_file).unlink(missing_ok=True)
    return [node_id for node_id, _ in answers]
