"""Recipe: contrastive bi-encoder training on Ray Train workers (gloo on CPU, NCCL on GPU).

Driver side: `fit_retriever` ships the training data and the initial encoder weights through the object store to
the training harness (ragtrain/train/harness.py: a TorchTrainer sized by `resources.trainer`) and returns the
trained weights from the final checkpoint. Worker side: `train_loop_per_worker` reads typed `WorkerArgs` (never
Hydra) top to bottom: set-up -> train -> summarise and save.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from ragtrain.config import Config
from ragtrain.embed.model import BiEncoder, autocast, build_encoder, encode_texts, load_tokenizer, tokenize
from ragtrain.index.refresh import LiveIndexClient, Probe, staleness
from ragtrain.precision import resolve
from ragtrain.retriever.batching import TrainData, local_batch, local_indices
from ragtrain.retriever.gradcache import cached_step
from ragtrain.retriever.lora import apply_lora, plain_state_dict, trainable
from ragtrain.retriever.loss import contrastive_loss
from ragtrain.retriever.teacher_loss import distill_term, teacher_matrix
from ragtrain.retriever.validation import ValSet, validate
from ragtrain.rss import peak_rss_mb
from ragtrain.schedule import warmup_linear_decay
from ragtrain.sync.comm import STATS
from ragtrain.sync.drift import drift_metrics
from ragtrain.sync.registry import build_sync
from ragtrain.track.mlflow import MetricSink
from ragtrain.train.harness import Worker, WorkerArgs, fit, total_steps


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


def load_state(encoder: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load weights strictly: a key mismatch means a different architecture, which must not pass silently."""
    encoder.load_state_dict(state, strict=True)


def save_weights(state: dict[str, torch.Tensor], folder: str | Path, name: str = "encoder") -> Path:
    """Save encoder weights as safetensors (no pickle) in `folder` as `<name>.safetensors`."""
    from safetensors.torch import save_file

    path = Path(folder) / f"{name}.safetensors"
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path))
    return path


def load_weights(folder: str | Path, name: str = "encoder") -> dict[str, torch.Tensor]:
    """Load weights saved by `save_weights`."""
    from safetensors.torch import load_file

    path = Path(folder) / f"{name}.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"no encoder weights at {path} (expected a ragtrain retriever checkpoint)")
    return load_file(str(path))


def drift_probe(data: TrainData, cfg: Config) -> tuple[list[str], list[str]]:
    """The fixed drift probe set: the first sync.probe_passages training queries and their positive passages."""
    exs = data.examples[: min(cfg.sync.probe_passages, len(data.examples))]
    return [e.query for e in exs], [data.passages[e.positive] for e in exs]


def train_loop_per_worker(args: WorkerArgs) -> None:
    """One Ray Train worker: set up the replica -> train -> measure drift -> save the final weights."""
    import ray
    import ray.train

    cfg = args.cfg
    t, teach = cfg.retriever.train, cfg.retriever.teacher
    distill = distill_term(teach.loss)  # KL or MarginMSE, chosen once
    # Dropout draws from torch's default generator: seed it per (seed, rank), or two runs of one config differ.
    w = Worker(args, seed=t.seed * 10007 + ray.train.get_context().get_world_rank())
    device, rank, world = w.device, w.rank, w.world
    resolve(t.precision, device, "retriever.train.precision", announce=rank == 0)  # auto: said once, by rank 0

    # --- set-up
    data: TrainData = w.get("data")
    encoder = build_encoder(cfg.retriever)
    load_state(encoder, w.get("weights"))
    apply_lora(encoder, cfg.retriever.lora)  # retriever.lora.rank > 0: only the adapters train (lora.py)
    encoder.to(device).train()
    tokenizer = load_tokenizer(cfg.retriever)
    node_ids = [ray.get_runtime_context().get_node_id()]
    if world > 1:  # every rank learns every rank's node (hierarchical sync groups by node)
        node_ids = [None] * world
        torch.distributed.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    strategy = build_sync(cfg.sync, node_ids)
    # wrap before the restore: DDP broadcasts rank 0's weights when it is built, which would erase the restored
    # per-rank replicas of local SGD / gossip; the strategy's own state is loaded after the weights (below).
    model = strategy.wrap(QPEncoder(encoder), device)  # DDP + comm hook, or the bare module (local steps)
    params = trainable(encoder)  # what the optimizer updates and parameter mixers send (LoRA: the adapters)
    STATS.reset()
    STATS.cuda = device.type == "cuda"  # NCCL collectives: timed by CUDA events and synchronisation (sync/comm.py)
    drift_texts = drift_probe(data, cfg)

    def embed(texts: list[str], role: str) -> torch.Tensor:  # this replica's vectors, the one embedding path (CPU)
        n = cfg.retriever.query_max_length if role == "query" else cfg.retriever.passage_max_length
        return encode_texts(encoder, tokenizer, texts, n, 32, t.precision, device, role=role)

    global_batch = t.batch_size * world
    steps = total_steps(t.max_steps, t.epochs, len(data.examples), global_batch)
    optim = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    sched = warmup_linear_decay(optim, int(t.warmup_ratio * steps), steps)
    start_step, sync_state = w.restore(encoder, optim, sched)
    if start_step:  # after the weights: e.g. async_ps re-anchors each worker at its restored replica
        strategy.load_state_dict(sync_state)

    val: ValSet | None = w.get("val") if args.refs.get("val") is not None else None  # retriever.train.val_every
    live: LiveIndexClient | None = None
    if args.refs.get("index_service") is not None:  # refresh.enabled: hard negatives from the live index
        # Rank 0 broadcasts each step's index version where the strategy has per-step collectives anyway;
        # async_ps has none (a broadcast would make its workers wait for each other): the service decides there.
        live = LiveIndexClient(
            w.get("index_service"), cfg, rank, broadcast=world > 1 and strategy.gather_negatives, device=device
        )
        probe: Probe = w.get("probe")
        probe_texts = [data.passages[r] for r in probe.rows]

        def measure(stale):  # rank 0: the current encoder on the staleness probe
            p_vec, q_vec = embed(probe_texts, "passage"), embed(probe.queries, "query")
            return staleness(stale, p_vec.numpy(), q_vec.numpy(), probe.gold)

    # --- train
    window_n, window_loss = 0, 0.0
    # this rank's distillation term (KL or MarginMSE; retriever.teacher.weight > 0): the log window's, the run's
    distill_sum = [0.0, 0.0]
    last_bytes, last_comm_s = 0, 0.0
    drift_history: list[dict[str, float]] = []
    loop_start = time.perf_counter()
    w.window_seconds()  # the first log window starts here, after the set-up
    for step in range(start_step, steps):
        step_start = time.perf_counter()
        if live is not None:
            live.begin_step(step)  # every rank mines this step from the version rank 0 chose
        queries, pids, golds = local_batch(
            data,
            global_batch,
            step,
            t.seed,
            rank,
            world,
            t.hard_negatives,
            live.negatives() if live else None,
            t.hard_negative_sampling.value,
        )
        q = {
            k: v.to(device)
            for k, v in tokenize(tokenizer, queries, cfg.retriever.query_max_length, role="query").items()
        }
        p_texts = [data.passages[i] for i in pids]
        p = {
            k: v.to(device)
            for k, v in tokenize(tokenizer, p_texts, cfg.retriever.passage_max_length, role="passage").items()
        }
        gmax = max(len(g) for g in golds)
        q_gold = torch.tensor([g + [-1] * (gmax - len(g)) for g in golds], device=device)
        targets = None
        if teach.weight > 0:  # the cross-encoder's scores of this batch's candidates (retriever/teacher_loss.py)
            qidx = [
                data.examples[i].qidx
                for i in local_indices(len(data.examples), global_batch, step, t.seed, rank, world)
            ]
            targets = teacher_matrix(data.teacher, qidx, pids, t.hard_negatives)

        def loss_fn(q_emb: torch.Tensor, p_emb: torch.Tensor) -> torch.Tensor:
            loss = contrastive_loss(
                q_emb,
                p_emb,
                cfg.retriever.temperature,
                q_gold,
                torch.tensor(pids, device=device),
                strategy.gather_negatives,
                grad_groups=strategy.gradient_groups(step),  # whose gathered passages carry gradients (loss.py)
            )
            if targets is not None:
                term = distill(q_emb, p_emb, targets, cfg.retriever.temperature, teach.temperature)
                distill_sum[0] += term.item()
                distill_sum[1] += term.item()
                loss = loss + teach.weight * term
            return loss

        optim.zero_grad(set_to_none=True)
        if t.cache_chunk_size > 0:  # GradCache: the same gradients, one chunk's activations at a time
            loss = cached_step(model, q, p, t.cache_chunk_size, loss_fn, lambda: autocast(t.precision, device), device)
        else:
            with autocast(t.precision, device):
                q_emb, p_emb = model(q, p)
            loss = loss_fn(q_emb, p_emb)
            loss.backward()
        if t.grad_clip > 0:  # per group: a layer-wise strategy's every-step group must get one coefficient everywhere
            for group in strategy.clip_groups(params):
                torch.nn.utils.clip_grad_norm_(group, t.grad_clip)
        optim.step()
        sched.step()
        strategy.after_step(params, step)
        done = step + 1
        if live is not None:
            step_s = time.perf_counter() - step_start
            with w.not_training():  # staleness probes and snapshots are not training time
                index_metrics = live.after_step(done, lambda: plain_state_dict(encoder), measure, step_s, global_batch)
            if index_metrics:
                w.log(index_metrics, done, steps)

        window_n += global_batch
        window_loss += loss.item()  # a sync point, but we need the number for logging anyway
        if done % t.log_every == 0 or done == steps:
            elapsed = w.window_seconds()
            n_steps = window_n // global_batch
            if world > 1:  # the global mean loss: each rank's loss is the mean over its own queries
                lt = torch.tensor([window_loss], device=device)
                torch.distributed.all_reduce(lt)
                window_loss = lt.item() / world
            comm_bytes, comm_s = STATS.total_bytes(), STATS.total_seconds()
            metrics = {
                "train/loss": window_loss / n_steps,
                "train/samples_per_s": window_n / elapsed,
                "train/lr": sched.get_last_lr()[0],
                "comm/bytes_per_step": (comm_bytes - last_bytes) / n_steps,
                "comm/time_share": (comm_s - last_comm_s) / elapsed,
                **strategy.state(),
            }
            if teach.weight > 0:
                metrics[f"train/teacher_{teach.loss.value}"] = distill_sum[0] / n_steps
                distill_sum[0] = 0.0
            if val is not None and rank == 0 and (done % t.val_every == 0 or done == steps):
                with w.not_training():  # rank 0 encodes the validation sample: not training time
                    metrics.update(
                        validate(
                            encoder,
                            tokenizer,
                            val,
                            cfg.retriever.query_max_length,
                            cfg.retriever.passage_max_length,
                            t.precision,
                            device,
                        )
                    )
            last_bytes, last_comm_s = comm_bytes, comm_s
            w.log(metrics, done, steps, report=True)  # Tune trials see every window
            window_n, window_loss = 0, 0.0
        if (cfg.sync.eval_every and done % cfg.sync.eval_every == 0) or done == steps:
            with w.not_training():  # every worker takes part (collectives)
                q_vec, p_vec = embed(drift_texts[0], "query").to(device), embed(drift_texts[1], "passage").to(device)
                drift = drift_metrics(params, q_vec, p_vec)
            drift_history.append(drift)
            w.log(drift, done, steps)
        if cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0 and done < steps:
            w.checkpoint(done, encoder, optim, sched, strategy.state_dict())
        w.end_step(done, steps)

    # --- summarise and save
    loop_s = time.perf_counter() - loop_start - w.measure_s
    ran = steps - start_step  # steps of this attempt (after a restart: since the checkpoint)
    if live is not None and rank == 0:
        live.drain()
    summary = {
        "step": steps,
        "train/samples_per_s": ran * global_batch / loop_s,
        "comm/bytes_per_step": STATS.total_bytes() / ran,
        "comm/time_share": STATS.total_seconds() / loop_s,
        **{f"comm/bytes_per_step/{k}": v / ran for k, v in STATS.bytes.items()},  # grad, params, embeddings, ...
        **strategy.state(),
        **{f"{k}_mean": sum(d[k] for d in drift_history) / len(drift_history) for k in drift_history[0]},
        **(live.summary() if live is not None and rank == 0 else {}),
        **({f"train/teacher_{teach.loss.value}": distill_sum[1] / ran} if teach.weight > 0 else {}),
        "train/peak_rss_mb": peak_rss_mb(),  # this worker's (rank 0's) peak resident set: what a batch recipe costs
        # on a GPU the activations and optimizer state are device memory, which RSS does not see
        **({"train/peak_gpu_mb": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else {}),
    }
    strategy.consensus(params)  # replicas -> the consensus model (parameter mean) that gets saved and indexed
    replicas = None
    if strategy.keeps_replicas and world > 1:  # rank 0 collects every replica (vector averaging at index time)
        replicas = [None] * world if rank == 0 else None
        torch.distributed.gather_object({k: v.cpu() for k, v in plain_state_dict(encoder).items()}, replicas, dst=0)

    def write(folder: Path) -> None:  # LoRA merged: the index pool and export load a plain encoder
        save_weights(plain_state_dict(encoder), folder)
        for r, state in enumerate(replicas or []):
            save_weights(state, folder, name=f"replica_{r}")

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
    import ray

    r, t = cfg.resources.trainer, cfg.retriever.train
    # fails here, on the driver, if the data is too small for one global batch
    steps = total_steps(t.max_steps, t.epochs, len(data.examples), t.batch_size * r.num_workers)
    cfg = replace(cfg, resume=resume)
    refs = {
        "data": ray.put(data),
        "weights": ray.put(init_weights),
        "index_service": index_service,
        "probe": probe,
        "val": ray.put(val) if val is not None else None,
    }
    args = WorkerArgs(
        cfg,
        "retriever",
        cpus_per_worker=r.cpus_per_worker,
        sink=sink,
        report_intermediate=report_intermediate,
        refs=refs,
    )
    done = fit(train_loop_per_worker, args, num_workers=r.num_workers, callbacks=callbacks)
    weights = load_weights(done.folder)
    replicas = [load_weights(done.folder, p.stem) for p in sorted(done.folder.glob("replica_*.safetensors"))]
    metrics = {k: float(v) for k, v in done.summary.items() if k != "step"}
    return FitResult(weights, metrics, done.checkpoint_path, steps, done.seconds, replicas)


if __name__ == "__main__":  # pragma: no cover - the recipe runs through `python -m ragtrain`
    raise SystemExit("run `python -m ragtrain experiment=NAME`")
