"""A pool of CPU Ray actors that encode corpus shards with an encoder snapshot from the object store."""

from __future__ import annotations

import copy
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
import torch
from ray.experimental.tqdm_ray import tqdm as ray_tqdm
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm import tqdm

from ragtrain.config import IndexConfig, PoolResources, Precision, RetrieverConfig
from ragtrain.console import get_logger
from ragtrain.embed.model import build_encoder, encode_texts, inference_weights, load_tokenizer
from ragtrain.precision import resolve

log = get_logger(__name__)

SHARDS_PER_ACTOR = 8  # load balance: the pool hands out small shards as actors free up
MAX_SHARD_RETRIES = 3  # a shard whose actor dies goes to another actor, at most this many times


@ray.remote
class EncoderActor:
    """Holds one encoder replica; loads new weights only when the snapshot version changes."""

    def __init__(self, retriever: RetrieverConfig, num_threads: int):
        # Ray sets OMP_NUM_THREADS from num_cpus, but torch may already have read it: set intra-op threads here.
        torch.set_num_threads(max(1, num_threads))
        self.cfg = retriever
        self.model = build_encoder(retriever).eval()
        self.tokenizer = load_tokenizer(retriever)
        self.version = None
        self.bf16_model = None  # a bf16-weight copy of this version, made on the first bf16 encode

    def set_weights(self, version: Any, weights: dict[str, torch.Tensor]) -> None:
        """Load a snapshot (Ray resolves the ObjectRef argument: each actor fetches it once)."""
        # A strict load that fails has already copied the matching tensors: forget the version first, so a failed
        # load can never serve a silent mix of old and new weights (encode results are version-checked).
        self.version, self.bf16_model = None, None
        self.model.load_state_dict(weights, strict=True)
        self.model.eval()
        self.version = version

    def encode(
        self,
        shard_id: int,
        texts: Sequence[str],
        max_length: int,
        batch_size: int,
        precision: str,
        die: bool = False,
        role: str = "passage",
    ) -> tuple[int, Any, np.ndarray]:
        """Embed one shard (length-sorted batches inside; `role` picks the configured query / passage prefix);
        returns (shard id, weights version, [n, dim] fp32)."""
        if die:  # fault.kill_pool_actor_at_shard: the process dies as in a crash (no cleanup, no exception)
            os._exit(1)
        model = self.model
        precision = resolve(precision, next(model.parameters()).device, "index.precision", announce=False)
        if Precision(precision) == Precision.bf16:  # as the Ray Data actors encode: bf16 weights, not autocast
            if self.bf16_model is None:
                self.bf16_model = inference_weights(copy.deepcopy(self.model), Precision.bf16)
            model = self.bf16_model
        vecs = encode_texts(model, self.tokenizer, texts, max_length, batch_size, Precision(precision), role=role)
        return shard_id, self.version, vecs.numpy()

    def node_id(self) -> str:
        """The Ray node this actor runs on (placement tests)."""
        return ray.get_runtime_context().get_node_id()


def make_shards(texts: Sequence[str], shard_size: int, min_shards: int = 1) -> list[list[int]]:
    """Split corpus positions into shards of similar text length (sorted globally), so padding stays small.

    Shards shrink until there are at least `min_shards`: with length-sorted shards the first ones are the
    slowest, and only many small shards let the actor pool balance the load (one 512-doc shard per actor left
    one actor idle half the time on 1,000 SciFact docs).
    """
    lengths = texts.lengths() if hasattr(texts, "lengths") else [len(t) for t in texts]  # a store's view: one pass
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    size = max(1, min(shard_size, -(-len(order) // max(1, min_shards))))
    return [order[i : i + size] for i in range(0, len(order), size)]


PLACEMENT_TIMEOUT_S = 30.0


class EncoderPool:
    """N `EncoderActor`s sized by resources.pool; `encode` fans shards out and gathers vectors in corpus order.

    Shards are handed out by hand rather than through `ray.util.ActorPool`, which gives up when an actor dies:
    here the dead actor's shard goes back to the queue and a replacement actor starts in the same bundle.

    The actors live in their own placement group (one bundle per actor, custom resources included), so the
    CPUs they hold are reserved for index building and never handed to trainer or generator workers.
    """

    def __init__(self, retriever: RetrieverConfig, pool: PoolResources, start_actors: bool = True):
        """start_actors=False: only the reservation (the placement group), for work that runs in its bundles on
        other actors' threads (the live refresh over index shards)."""
        self.retriever, self.resources = retriever, pool
        self._weights_ref: Any = None  # the current snapshot: a replacement actor loads it
        self.fault_shard = -1  # fault.kill_pool_actor_at_shard (once per pool)
        self.retried_shards = 0
        bundle = {"CPU": float(pool.cpus_per_actor), **{k: float(v) for k, v in pool.resources.items()}}
        self.placement_group = placement_group([bundle] * pool.num_actors, strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:  # feasible on paper (checked up front) but held by someone else: say so instead of hanging
            remove_placement_group(self.placement_group)
            raise TimeoutError(
                f"resources.pool: {pool.num_actors} x {bundle} could not be reserved within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s "
                f"(free now: {ray.available_resources()}); other work holds them"
            )
        self.actors = [self._start_actor(i) for i in range(pool.num_actors)] if start_actors else []
        self._version: Any = None

    def _start_actor(self, bundle_index: int):
        """An encoder actor in bundle `bundle_index` of the pool's placement group."""
        return EncoderActor.options(
            num_cpus=self.resources.cpus_per_actor,
            resources=dict(self.resources.resources) or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=bundle_index
            ),
        ).remote(self.retriever, int(self.resources.cpus_per_actor))

    def _replace(self, actor) -> Any:
        """Start a replacement for a dead actor in its bundle, loaded with the current snapshot."""
        i = self.actors.index(actor)
        fresh = self._start_actor(i)
        ray.get(fresh.set_weights.remote(self._version, self._weights_ref))
        self.actors[i] = fresh
        return fresh

    @property
    def version(self) -> Any:
        """The snapshot version every actor holds (None before the first set_weights)."""
        return self._version

    def set_weights(self, version: Any, weights_ref: ray.ObjectRef) -> None:
        """Send a weights snapshot to every actor through the object store (one put, N gets)."""
        self._version = None  # a failed load leaves actors without a known snapshot: encode must refuse
        ray.get([a.set_weights.remote(version, weights_ref) for a in self.actors])
        self._version, self._weights_ref = version, weights_ref

    def invalidate(self) -> None:
        """Forget which snapshot the actors hold (another holder of this pool may have loaded new weights)."""
        self._version = None

    def encode(
        self,
        texts: Sequence[str],
        max_length: int,
        index: IndexConfig,
        progress: bool = True,
        desc: str = "encode",
        role: str = "passage",
    ) -> tuple[np.ndarray, dict]:
        """Embed all texts (truncated to max_length; `role`: "passage" or "query", for retriever.*_prefix) with the
        current snapshot: ([N, dim] fp32 in input order, stats)."""
        if not self.actors:
            raise RuntimeError("EncoderPool.encode called after shutdown, or on a pool started without actors")
        if self._version is None:
            raise RuntimeError("EncoderPool.encode called before set_weights")
        if not texts:
            raise ValueError("EncoderPool.encode called with no texts")
        shards = make_shards(texts, index.shard_size, min_shards=SHARDS_PER_ACTOR * len(self.actors))
        start = time.perf_counter()
        out = np.empty((0, 0), dtype=np.float32)
        todo = deque(range(len(shards)))
        idle = list(self.actors)
        running: dict[Any, tuple[int, Any]] = {}  # ObjectRef -> (shard id, actor)
        attempts = [0] * len(shards)
        bar = None
        if progress and ray.get_runtime_context().get_actor_id():  # in an actor (the live service): drawn by the driver
            bar = ray_tqdm(total=len(texts), desc=desc, unit="doc")
        elif progress:
            bar = tqdm(total=len(texts), desc=desc, unit="doc", mininterval=2.0)
        while todo or running:
            while todo and idle:  # hand shards to free actors as they free up (length-sorted: slowest first)
                sid, actor = todo.popleft(), idle.pop()
                die = sid == self.fault_shard
                self.fault_shard = -1 if die else self.fault_shard
                shard = texts[shards[sid]] if hasattr(texts, "lengths") else [texts[i] for i in shards[sid]]
                ref = actor.encode.remote(
                    sid, shard, max_length, index.batch_size, Precision(index.precision).value, die, role
                )
                running[ref] = (sid, actor)
            [ref], _ = ray.wait(list(running), num_returns=1)
            sid, actor = running.pop(ref)
            try:
                _, version, vecs = ray.get(ref)
            except ray.exceptions.RayActorError as e:  # the actor died: its shard goes to another actor
                attempts[sid] += 1
                if attempts[sid] > MAX_SHARD_RETRIES:
                    raise RuntimeError(f"shard {sid} failed {attempts[sid]} times (last: {e}); giving up") from None
                log.info(f"[pool] an encoder actor died on shard {sid}; retrying it and starting a replacement")
                self.retried_shards += 1
                todo.appendleft(sid)
                idle.append(self._replace(actor))
                continue
            if version != self._version:  # an actor that missed a snapshot would silently mix encoders
                raise RuntimeError(f"shard {sid} was encoded with weights {version}, expected {self._version}")
            if out.size == 0:
                out = np.empty((len(texts), vecs.shape[1]), dtype=np.float32)
            out[shards[sid]] = vecs  # each shard is written once: every text lands in exactly one row
            if bar is not None:
                bar.update(len(shards[sid]))
            idle.append(actor)
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - start
        stats = {
            "docs": len(texts),
            "seconds": seconds,
            "docs_per_s": len(texts) / max(seconds, 1e-9),
            "retried_shards": float(sum(attempts)),
        }
        return out, stats

    def node_ids(self) -> list[str]:
        """Node id of each actor."""
        return ray.get([a.node_id.remote() for a in self.actors])

    def shutdown(self) -> None:
        """Kill the actors and release their placement group (the CPUs return to the cluster)."""
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
