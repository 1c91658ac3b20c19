"""Recipe: contrastive bi-encoder training on Ray Train workers (gloo on CPU, NCCL on GPU).

Driver side: `fit_retriever` ships the training data and the initial encoder weights through the object store to
the training harness (ragtrain/train/harness.py: a TorchTrainer sized by `resources.trainer`) and returns the
trained weights from the final checkpoint. Worker side: `train_loop_per_worker` reads typed `WorkerArgs` (never
Hydra) top to bottom: set-up -> train -> summarise and save.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
import torch
from torch import nn

from ragtrain.config import Config
from ragtrain.embed.model import BiEncoder, autocast, build_encoder, encode_texts, load_tokenizer, tokenize
from ragtrain.embed.precision import resolve
from ragtrain.embed.weights import load_state, load_weights, save_weights
from ragtrain.index.live_client import LiveIndexClient, Probe, staleness
from ragtrain.retriever.batching import TrainData, local_batch, local_indices
from ragtrain.retriever.gradcache import cached_step
from ragtrain.retriever.lora import apply_lora, plain_state_dict, trainable
from ragtrain.retriever.loss import contrastive_loss
from ragtrain.retriever.teacher.base import build_teacher_loss, teacher_matrix
from ragtrain.retriever.validation import ValSet, validate
from ragtrain.runtime.console import get_logger
from ragtrain.runtime.rss import peak_rss_mb
from ragtrain.sync.base import SyncStrategy
from ragtrain.sync.comm import STATS
from ragtrain.sync.composed import build_sync
from ragtrain.sync.drift import drift_metrics
from ragtrain.track.mlflow import MetricSink
from ragtrain.train.checkpoint import CheckpointError
from ragtrain.train.harness import Worker, WorkerArgs, fit, total_steps
from ragtrain.train.schedule import warmup_linear_decay

log = get_logger(__name__)


class QPEncoder(nn.Module):
    """Embeds queries and passages in ONE forward call, so DDP sees one forward per backward."""

    def __init__(self, encoder: BiEncoder):
        super().__init__()
        self.encoder = encoder

    def forward(
        self, q: dict[str, torch.Tensor] | None, p: dict[str, torch.Tensor] | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # either side may be None: GradCache (gradcache.py) embeds queries and passages in separate chunks
        return (None if q is None else self.encoder(**q)), (None if p is None else self.encoder(**p))


def checkpoint_weights(cfg: Config, folder: str | Path) -> dict[str, torch.Tensor]:
    """The encoder weights of a training checkpoint (rank 0's replica; LoRA adapters merged), as the live index
    and the pool load them: on the driver, where a resumed run's live index starts from them."""
    from safetensors.torch import load_model  # lazy: only a resumed run's driver needs it (load_file does not merge
    # the tied tensors save_model stored once)

    encoder = build_encoder(cfg.retriever)
    apply_lora(encoder, cfg.retriever.lora)  # the replica the workers trained and saved (lora.py)
    try:
        load_model(encoder, str(Path(folder) / "rank0.safetensors"), strict=True)
    except Exception as e:  # a truncated file, another architecture
        raise CheckpointError(
            f"checkpoint {folder} is corrupt or incompatible ({type(e).__name__}: {e}); delete it to fall back to "
            "an earlier one, or start a new run (resume=false)"
        ) from None
    return {k: v.detach().clone() for k, v in plain_state_dict(encoder).items()}


def drift_probe(data: TrainData, cfg: Config) -> tuple[list[str], list[str]]:
    """The fixed drift probe set: the first sync.probe_passages training queries and their positive passages."""
    exs = data.examples[: min(cfg.sync.probe_passages, len(data.examples))]
    return [e.query for e in exs], [data.passages[e.positive] for e in exs]


class NoLiveIndex:
    """refresh.enabled=false: the loop's live-index calls do nothing (hard negatives come from the batch data)."""

    def begin_step(self, step: int) -> None:
        return None

    def negatives(self) -> None:
        return None

    def after_step(self, *args) -> dict[str, float]:
        return {}

    def drain(self) -> dict[str, float]:
        return {}

    def checkpoint_info(self) -> dict[str, int]:
        return {}

    def summary(self) -> dict[str, float]:
        return {}


class Distill:
    """This rank's teacher term (retriever.teacher.weight > 0: KL or MarginMSE to the cross-encoder's scores of the
    batch's candidates); with weight 0 it adds nothing and reports nothing."""

    def __init__(self, cfg: Config, data: TrainData) -> None:
        self.teach, self.t, self.data = cfg.retriever.teacher, cfg.retriever.train, data
        self.temperature = cfg.retriever.temperature
        self.term = build_teacher_loss(self.teach.loss)  # chosen once
        self.window = self.total = 0.0
        self.name = f"train/teacher_{self.teach.loss}"

    def targets(self, step: int, pids: list[int], gb: int, rank: int, world: int) -> torch.Tensor | None:
        """The teacher's scores of this step's candidates (retriever/teacher/base.py), or None without a teacher."""
        if self.teach.weight <= 0:
            return None
        qidx = [
            self.data.examples[i].qidx
            for i in local_indices(len(self.data.examples), gb, step, self.t.seed, rank, world)
        ]
        if self.data.teacher is None:
            raise ValueError("retriever.teacher.weight > 0 but the training data carries no teacher scores")
        return teacher_matrix(self.data.teacher, qidx, pids, self.t.hard_negatives)

    def add(self, loss: torch.Tensor, q_emb, p_emb, targets: torch.Tensor | None) -> torch.Tensor:
        if targets is None:
            return loss
        term = self.term(q_emb, p_emb, targets, self.temperature, self.teach.temperature)
        self.window += term.item()
        self.total += term.item()
        return loss + self.teach.weight * term

    def window_metrics(self, n_steps: int) -> dict[str, float]:
        out = {self.name: self.window / n_steps} if self.teach.weight > 0 else {}
        self.window = 0.0
        return out

    def run_metrics(self, ran: int) -> dict[str, float]:
        return {self.name: self.total / ran} if self.teach.weight > 0 else {}


@dataclass
class Replica:
    """One worker's set-up: its encoder replica wrapped by the sync strategy, the optimizer, the data and the
    optional parts (a live index, a teacher, a validation sample) as objects that do nothing when off."""

    args: WorkerArgs
    w: Worker
    data: TrainData
    encoder: BiEncoder
    tokenizer: object
    model: nn.Module
    strategy: SyncStrategy
    params: list[nn.Parameter]
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    steps: int
    start_step: int
    live: LiveIndexClient | NoLiveIndex
    distill: Distill
    val: ValSet | None
    measure: Callable[[Any], dict[str, float]] | None = None  # rank 0 with a live index: the staleness probe

    @property
    def cfg(self) -> Config:
        return self.args.cfg

    @property
    def global_batch(self) -> int:
        return self.cfg.retriever.train.batch_size * self.w.world

    def embed(self, texts: list[str], role: str) -> torch.Tensor:
        """This replica's vectors of `texts` (CPU), through the one embedding path."""
        r = self.cfg.retriever
        n = r.query_max_length if role == "query" else r.passage_max_length
        return encode_texts(self.encoder, self.tokenizer, texts, n, 32, r.train.precision, self.w.device, role=role)


@dataclass
class RetrieverInputs:
    """What the retriever stage's workers receive beside the config."""

    data: Any  # ObjectRef of the TrainData
    weights: Any  # ObjectRef of the initial encoder's state dict (every rank starts from it)
    index_service: Any = None  # the live index's actor (refresh.enabled)
    probe: Probe | None = None  # the staleness probe (with the live index)
    val: Any = None  # ObjectRef of the ValSet (retriever.train.val_every)


def setup_replica(args: WorkerArgs) -> Replica:
    """Build the replica, wrap it in the sync strategy, restore a checkpoint, connect the live index."""
    import ray.train  # lazy: ray.train imports ray.data and pandas (~0.8 s); this module imports without them

    cfg = args.cfg
    t = cfg.retriever.train
    # Dropout draws from torch's default generator: seed it per (seed, rank), or two runs of one config differ.
    w = Worker(args, seed=t.seed * 10007 + ray.train.get_context().get_world_rank())
    resolve(t.precision, w.device, "retriever.train.precision", announce=w.rank == 0)  # auto: said once, by rank 0
    inputs: RetrieverInputs = args.inputs
    data: TrainData = w.fetch(inputs.data)
    encoder = build_encoder(cfg.retriever)
    load_state(encoder, w.fetch(inputs.weights))
    apply_lora(encoder, cfg.retriever.lora)  # retriever.lora.rank > 0: only the adapters train (lora.py)
    encoder.to(w.device).train()
    node_ids = [ray.get_runtime_context().get_node_id()]
    if w.world > 1:  # every rank learns every rank's node (hierarchical sync groups by node)
        node_ids = [None] * w.world
        torch.distributed.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    strategy = build_sync(cfg.sync, node_ids)
    # wrap before the restore: DDP broadcasts rank 0's weights when it is built, which would erase the restored
    # per-rank replicas of local SGD / gossip; the strategy's own state is loaded after the weights (below).
    model = strategy.wrap(QPEncoder(encoder), w.device)  # DDP + comm hook, or the bare module (local steps)
    params = trainable(encoder)  # what the optimizer updates and parameter mixers send (LoRA: the adapters)
    STATS.reset()
    STATS.cuda = w.device.type == "cuda"  # NCCL collectives: timed by CUDA events and synchronisation (sync/comm.py)
    steps = total_steps(t.max_steps, t.epochs, len(data.examples), t.batch_size * w.world)
    optim = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    sched = warmup_linear_decay(optim, int(t.warmup_ratio * steps), steps)
    start_step, sync_state = w.restore(encoder, optim, sched)
    if start_step:  # after the weights: e.g. async_ps re-anchors each worker at its restored replica
        strategy.load_state_dict(sync_state)
    val = w.fetch(inputs.val)  # retriever.train.val_every (else None)
    r = Replica(args, w, data, encoder, load_tokenizer(cfg.retriever), model, strategy, params, optim, sched, steps,
                start_step, NoLiveIndex(), Distill(cfg, data), val)  # fmt: skip
    if inputs.index_service is not None:  # refresh.enabled: hard negatives from the live index
        if inputs.probe is None:
            raise ValueError("the live index comes with its staleness probe: fit_retriever(probe=...) is unset")
        connect_live_index(r, inputs.index_service, inputs.probe)
    return r


def connect_live_index(r: Replica, service: Any, probe: Probe) -> None:
    """The live index client. Rank 0 broadcasts each step's index version where the strategy has per-step
    collectives anyway; async_ps has none (a broadcast would make its workers wait for each other): the service
    decides there."""
    w = r.w
    broadcast = w.world > 1 and r.strategy.gather_negatives
    r.live = LiveIndexClient(service, r.cfg.refresh, w.rank, broadcast=broadcast, device=w.device)
    probe_texts = [r.data.passages[i] for i in probe.rows]

    def measure(stale):  # rank 0: the current encoder on the staleness probe
        p_vec, q_vec = r.embed(probe_texts, "passage"), r.embed(probe.queries, "query")
        return staleness(stale, p_vec.numpy(), q_vec.numpy(), probe.gold)

    r.measure = measure


def train_step(r: Replica, step: int) -> torch.Tensor:
    """One optimizer step of this replica on its share of the global batch; returns its loss."""
    cfg, t, device, w = r.cfg, r.cfg.retriever.train, r.w.device, r.w
    r.live.begin_step(step)  # every rank mines this step from the version rank 0 chose
    queries, pids, golds = local_batch(
        r.data, r.global_batch, step, t.seed, w.rank, w.world, t.hard_negatives, r.live.negatives(),
        t.hard_negative_sampling.value,
    )  # fmt: skip
    q = {k: v.to(device) for k, v in tokenize(r.tokenizer, queries, cfg.retriever.query_max_length, "query").items()}
    p_texts = [r.data.passages[i] for i in pids]
    p = {
        k: v.to(device) for k, v in tokenize(r.tokenizer, p_texts, cfg.retriever.passage_max_length, "passage").items()
    }
    gmax = max(len(g) for g in golds)
    q_gold = torch.tensor([g + [-1] * (gmax - len(g)) for g in golds], device=device)
    targets = r.distill.targets(step, pids, r.global_batch, w.rank, w.world)

    def loss_fn(q_emb: torch.Tensor, p_emb: torch.Tensor) -> torch.Tensor:
        loss = contrastive_loss(
            q_emb, p_emb, cfg.retriever.temperature, q_gold, torch.tensor(pids, device=device),
            r.strategy.gather_negatives,
            grad_groups=r.strategy.gradient_groups(step),  # whose gathered passages carry gradients (loss.py)
        )  # fmt: skip
        return r.distill.add(loss, q_emb, p_emb, targets)

    r.optim.zero_grad(set_to_none=True)
    if t.cache_chunk_size > 0:  # GradCache: the same gradients, one chunk's activations at a time
        loss = cached_step(r.model, q, p, t.cache_chunk_size, loss_fn, lambda: autocast(t.precision, device), device)
    else:
        with autocast(t.precision, device):
            q_emb, p_emb = r.model(q, p)
        loss = loss_fn(q_emb, p_emb)
        loss.backward()
    if t.grad_clip > 0:  # per group: a layer-wise strategy's every-step group must get one coefficient everywhere
        for group in r.strategy.clip_groups(r.params):
            torch.nn.utils.clip_grad_norm_(group, t.grad_clip)
    r.optim.step()
    r.sched.step()
    r.strategy.after_step(r.params, step)
    return loss


class LogWindow:
    """The metrics of every `retriever.train.log_every` steps: mean loss, samples/s, the cumulative training seconds,
    bytes sent, comm time share, the sync strategy's state, the teacher term and (rank 0) the validation sample's
    figures. With `retriever.train.max_train_seconds` it also decides, on every rank alike, when training stops."""

    def __init__(self, r: Replica) -> None:
        self.r, self.n, self.loss = r, 0, 0.0
        self.last_bytes, self.last_comm_s = 0, 0.0
        # training seconds of this fit so far (measurement excluded): the clock a time-to-accuracy is read from
        self.seconds = 0.0
        self.stop = False  # the time budget is spent: every rank ends training after this window

    def add(self, loss: float) -> None:
        self.n += self.r.global_batch
        self.loss += loss

    def agree(self, loss: float) -> tuple[float, bool]:
        """The global mean loss and whether any rank has spent the time budget, in the one collective the loss
        needs anyway (each rank's loss is the mean over its own queries): every rank stops at the same window."""
        r, cap = self.r, self.r.cfg.retriever.train.max_train_seconds
        spent = float(cap > 0 and self.seconds >= cap)
        if r.w.world == 1:
            return loss, spent > 0
        both = torch.tensor([loss, spent], device=r.w.device)
        torch.distributed.all_reduce(both)
        return both[0].item() / r.w.world, both[1].item() > 0

    def log(self, done: int) -> None:
        r, t = self.r, self.r.cfg.retriever.train
        elapsed = r.w.window_seconds()
        self.seconds += elapsed
        n_steps = self.n // r.global_batch
        loss, self.stop = self.agree(self.loss)
        comm_bytes, comm_s = STATS.total_bytes(), STATS.total_seconds()
        metrics = {
            "train/loss": loss / n_steps,
            "train/samples_per_s": self.n / elapsed,
            "train/seconds": self.seconds,
            "train/lr": r.sched.get_last_lr()[0],
            "comm/bytes_per_step": (comm_bytes - self.last_bytes) / n_steps,
            "comm/time_share": (comm_s - self.last_comm_s) / elapsed,
            **r.strategy.state(),
            **r.distill.window_metrics(n_steps),
        }
        last = done == r.steps or self.stop
        if r.val is not None and r.w.rank == 0 and (done % t.val_every == 0 or last):
            with r.w.not_training():  # rank 0 encodes the validation sample: not training time
                rc = r.cfg.retriever
                metrics.update(
                    validate(r.encoder, r.tokenizer, r.val, rc.query_max_length, rc.passage_max_length, t.precision,
                             r.w.device)
                )  # fmt: skip
        self.last_bytes, self.last_comm_s = comm_bytes, comm_s
        r.w.log(metrics, done, r.steps, report=True)  # Tune trials see every window
        self.n, self.loss = 0, 0.0


def log_stop(r: Replica, done: int, seconds: float) -> None:
    """End the fit at step `done`: from here the replica counts it as its last (the drift probe, the summary, the
    final checkpoint and the step the trained model is logged at all read `r.steps`)."""
    if r.w.rank == 0:
        cap = r.cfg.retriever.train.max_train_seconds
        log.info(
            f"[retriever] max_train_seconds={cap:g} spent ({seconds:.1f} s of training): stop at step {done}/{r.steps}"
        )
    r.steps = done


def measure_drift(r: Replica, done: int) -> dict[str, float]:
    """The replicas' drift on the fixed probe (every worker takes part: collectives)."""
    queries, passages = drift_probe(r.data, r.cfg)
    with r.w.not_training():
        q_vec, p_vec = r.embed(queries, "query").to(r.w.device), r.embed(passages, "passage").to(r.w.device)
        drift = drift_metrics(r.params, q_vec, p_vec)
    r.w.log(drift, done, r.steps)
    return drift


def train_loop_per_worker(args: WorkerArgs) -> None:
    """One Ray Train worker: set up the replica -> train (a step, the live index's upkeep, a log window, drift,
    a checkpoint) -> summarise and save."""
    r = setup_replica(args)
    cfg, t, w = r.cfg, r.cfg.retriever.train, r.w
    window, drift_history = LogWindow(r), []
    loop_start = time.perf_counter()
    w.window_seconds()  # the first log window starts here, after the set-up
    for step in range(r.start_step, r.steps):
        step_start = time.perf_counter()
        loss = train_step(r, step)
        done = step + 1
        with w.not_training():  # staleness probes and snapshots are not training time
            index_metrics = r.live.after_step(
                done, lambda: plain_state_dict(r.encoder), r.measure, time.perf_counter() - step_start, r.global_batch
            )
        if index_metrics:
            w.log(index_metrics, done, r.steps)
        window.add(loss.item())  # a sync point, but we need the number for logging anyway
        if done % t.log_every == 0 or done == r.steps:
            window.log(done)
        if window.stop and done < r.steps:  # the time budget is spent (max_train_seconds): this is the last step
            log_stop(r, done, window.seconds)
        last = done == r.steps
        if (cfg.sync.eval_every and done % cfg.sync.eval_every == 0) or last:
            drift_history.append(measure_drift(r, done))
        if cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0 and not last:
            w.checkpoint(done, r.encoder, r.optim, r.sched, r.strategy.state_dict(), info=r.live.checkpoint_info())
        w.end_step(done, r.steps)
        if last:
            break
    finish(r, time.perf_counter() - loop_start - w.measure_s, drift_history)


def finish(r: Replica, loop_s: float, drift_history: list[dict[str, float]]) -> None:
    """Rank 0's run summary, the consensus model (and every replica where the strategy keeps them), saved."""
    w, gb = r.w, r.global_batch
    ran = r.steps - r.start_step  # steps of this attempt (after a restart: since the checkpoint)
    if w.rank == 0:
        drained = r.live.drain()  # a refresh still running when training ended: its metrics, at the last step
        if drained:
            w.log(drained, r.steps, r.steps)
    summary = {
        "step": r.steps,
        "train/samples_per_s": ran * gb / loop_s,
        "train/seconds": loop_s,  # this attempt's training seconds (measurement excluded)
        "comm/bytes_per_step": STATS.total_bytes() / ran,
        "comm/time_share": STATS.total_seconds() / loop_s,
        **{f"comm/bytes_per_step/{k}": v / ran for k, v in STATS.bytes.items()},  # grad, params, embeddings, ...
        **r.strategy.state(),
        **{f"{k}_mean": sum(d[k] for d in drift_history) / len(drift_history) for k in drift_history[0]},
        **(r.live.summary() if w.rank == 0 else {}),
        **r.distill.run_metrics(ran),
        "train/peak_rss_mb": peak_rss_mb(),  # this worker's (rank 0's) peak resident set: what a batch recipe costs
        # on a GPU the activations and optimizer state are device memory, which RSS does not see
        **({"train/peak_gpu_mb": torch.cuda.max_memory_allocated(w.device) / 2**20} if w.device.type == "cuda" else {}),
    }
    r.strategy.consensus(r.params)  # replicas -> the consensus model (parameter mean) that gets saved and indexed
    replicas: list[Any] | None = None  # rank 0: gather_object fills it with every replica's state dict
    if r.strategy.keeps_replicas and w.world > 1:  # rank 0 collects every replica (vector averaging at index time)
        replicas = [None] * w.world if w.rank == 0 else None
        torch.distributed.gather_object({k: v.cpu() for k, v in plain_state_dict(r.encoder).items()}, replicas, dst=0)

    def write(folder: Path) -> None:  # LoRA merged: the index pool and export load a plain encoder
        save_weights(plain_state_dict(r.encoder), folder)
        for i, state in enumerate(replicas or []):
            save_weights(state, folder, name=f"replica_{i}")

    w.finish(summary, write)


@dataclass
class FitResult:
    weights: dict[str, torch.Tensor]
    metrics: dict[str, float]  # rank 0's run summary: samples/s, bytes/step, comm time share, mean drift
    checkpoint_path: str
    steps: int
    seconds: float
    replicas: list[dict[str, torch.Tensor]] = field(default_factory=list)  # vector_avg: every worker's replica


def fit_retriever(
    cfg: Config,
    data: TrainData,
    init_weights: dict[str, torch.Tensor],
    sink: MetricSink | None,
    callbacks: list | None = None,
    report_intermediate: bool = False,
    index_service=None,
    probe: Probe | None = None,
    resume: bool = False,
    val: ValSet | None = None,
) -> FitResult:
    """Driver: train the bi-encoder on the harness with resources.trainer workers; return the final weights."""
    r, t = cfg.resources.trainer, cfg.retriever.train
    # fails here, on the driver, if the data is too small for one global batch
    steps = total_steps(t.max_steps, t.epochs, len(data.examples), t.batch_size * r.num_workers)
    cfg = replace(cfg, resume=resume)
    inputs = RetrieverInputs(
        data=ray.put(data),
        weights=ray.put(init_weights),
        index_service=index_service,
        probe=probe,
        val=ray.put(val) if val is not None else None,
    )
    args = WorkerArgs(
        cfg,
        "retriever",
        cpus_per_worker=r.cpus_per_worker,
        sink=sink,
        report_intermediate=report_intermediate,
        inputs=inputs,
    )
    done = fit(train_loop_per_worker, args, num_workers=r.num_workers, callbacks=callbacks)
    weights = load_weights(done.folder)
    replicas = [load_weights(done.folder, p.stem) for p in sorted(done.folder.glob("replica_*.safetensors"))]
    metrics = {k: float(v) for k, v in done.summary.items() if k != "step"}
    # the step training ended at: fewer than planned where max_train_seconds stopped it
    ran_to = int(done.summary.get("step", steps))
    return FitResult(weights, metrics, done.checkpoint_path, ran_to, done.seconds, replicas)


if __name__ == "__main__":  # pragma: no cover - the recipe runs through `python -m ragtrain`
    raise SystemExit("run `python -m ragtrain experiment=NAME`")
