"""Recipe: contrastive bi-encoder training on Ray Train workers (gloo on CPU, NCCL on GPU).

Driver side: `fit_retriever` sizes a `TorchTrainer` from `resources.trainer`, ships the training data and the
initial encoder weights through the object store, and returns the trained weights from the final checkpoint.
Worker side: `train_loop_per_worker` reads a resolved, typed config; it never sees Hydra.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ragtrain.cluster.resources import WORKER_ENV, record_placement_group
from ragtrain.config import Config
from ragtrain.retriever.batching import TrainData, local_batch, steps_per_epoch
from ragtrain.index.refresh import LiveIndexClient, Probe, staleness
from ragtrain.checkpoint import maybe_inject_fault, restore_in_worker, resume_point, save_train_state
from ragtrain.retriever.encoder import BiEncoder, autocast, build_encoder, encode_texts, load_tokenizer, tokenize
from ragtrain.retriever.loss import contrastive_loss
from ragtrain.schedule import warmup_linear_decay
from ragtrain.sync.base import build_sync
from ragtrain.sync.comm import STATS
from ragtrain.sync.metrics import drift_metrics
from ragtrain.track.mlflow import MetricSink



class QPEncoder(nn.Module):
    """Embeds queries and passages in ONE forward call, so DDP sees one forward per backward."""

    def __init__(self, encoder: BiEncoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, q: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(**q), self.encoder(**p)


def total_steps(cfg: Config, num_examples: int) -> int:
    """Optimizer steps of the run: max_steps, else epochs x full global batches per epoch."""
    t = cfg.retriever.train
    spe = steps_per_epoch(num_examples, t.batch_size * cfg.resources.trainer.num_workers)
    return t.max_steps if t.max_steps > 0 else max(1, math.ceil(t.epochs * spe))


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


def probe_inputs(data: TrainData, cfg: Config, tokenizer, device: torch.device) -> tuple[dict, dict]:
    """The fixed drift probe set: the first sync.probe_passages training queries and their positive passages."""
    n = min(cfg.sync.probe_passages, len(data.examples))
    exs = data.examples[:n]
    q = tokenize(tokenizer, [e.query for e in exs], cfg.retriever.query_max_length)
    p = tokenize(tokenizer, [data.passages[e.positive] for e in exs], cfg.retriever.passage_max_length)
    return {k: v.to(device) for k, v in q.items()}, {k: v.to(device) for k, v in p.items()}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: build the replica, train for the configured steps, report the final checkpoint."""
    import ray
    import ray.train
    import ray.train.torch

    cfg: Config = config["cfg"]
    t = cfg.retriever.train
    torch.set_num_threads(max(1, int(cfg.resources.trainer.cpus_per_worker)))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if rank == 0:  # Ray Train's worker group: a sweep removes it if this trial is stopped (cluster/resources.py)
        record_placement_group(cfg.output_dir, ray.util.get_current_placement_group())
    # Dropout draws from torch's default generator: seed it per (seed, rank), or two runs of one config differ.
    # (A restart then restores the checkpoint's RNG state over this.)
    torch.manual_seed(t.seed * 10007 + rank)

    data: TrainData = ray.get(config["data_ref"])
    encoder = build_encoder(cfg.retriever)
    load_state(encoder, ray.get(config["weights_ref"]))
    encoder.to(device).train()
    tokenizer = load_tokenizer(cfg.retriever)

    node_ids = [ray.get_runtime_context().get_node_id()]
    if world > 1:  # every rank learns every rank's node (hierarchical sync groups by node)
        node_ids = [None] * world
        torch.distributed.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    strategy = build_sync(cfg.sync, node_ids)
    model = strategy.wrap(QPEncoder(encoder), device)  # DDP + comm hook, or the bare module (local steps)
    params = list(encoder.parameters())
    STATS.reset()
    probe_q, probe_p = probe_inputs(data, cfg, tokenizer, device)

    steps = total_steps(cfg, len(data.examples))
    global_batch = t.batch_size * world
    optim = torch.optim.AdamW(encoder.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    warmup = int(t.warmup_ratio * steps)
    sched = warmup_linear_decay(optim, warmup, steps)
    sink: Optional[MetricSink] = config.get("sink") if rank == 0 else None
    start_step, sync_state, sink = restore_in_worker(Path(cfg.output_dir, "ray", "retriever"), config, rank, world,
                                                     encoder, optim, sched, sink, "retriever")
    if start_step:
        strategy.load_state_dict(sync_state)
    if sink is not None:
        sink.warm_up()  # before step 0: rank 1 would otherwise wait ~2.5 s for rank 0 at the first collective

    live: Optional[LiveIndexClient] = None
    if config.get("index_service") is not None:  # refresh.enabled: hard negatives from the live index
        # Rank 0 broadcasts each step's index version where the strategy has per-step collectives anyway;
        # async_ps has none (a broadcast would make its workers wait for each other): the service decides there.
        live = LiveIndexClient(config["index_service"], cfg, rank, broadcast=world > 1 and strategy.gather_negatives)
        probe: Probe = config["probe"]
        probe_texts = [data.passages[r] for r in probe.rows]

        def measure(stale):  # rank 0: the current encoder on the staleness probe
            p_vec = encode_texts(encoder, tokenizer, probe_texts, cfg.retriever.passage_max_length, 32, t.precision, device)
            q_vec = encode_texts(encoder, tokenizer, probe.queries, cfg.retriever.query_max_length, 32, t.precision, device)
            return staleness(stale, p_vec.numpy(), q_vec.numpy(), probe.gold)

    window_t, window_n, window_loss = time.perf_counter(), 0, 0.0
    last_bytes, last_comm_s = 0, 0.0
    drift_history: list[dict[str, float]] = []
    loop_start, measure_s = time.perf_counter(), 0.0
    for step in range(start_step, steps):
        step_start = time.perf_counter()
        if live is not None:
            live.begin_step(step)  # every rank mines this step from the version rank 0 chose
        queries, pids, golds = local_batch(
            data, global_batch, step, t.seed, rank, world, t.hard_negatives, live.negatives() if live else None
        )
        q = {k: v.to(device) for k, v in tokenize(tokenizer, queries, cfg.retriever.query_max_length).items()}
        p_texts = [data.passages[i] for i in pids]
        p = {k: v.to(device) for k, v in tokenize(tokenizer, p_texts, cfg.retriever.passage_max_length).items()}
        gmax = max(len(g) for g in golds)
        q_gold = torch.tensor([g + [-1] * (gmax - len(g)) for g in golds], device=device)
        with autocast(t.precision, device):
            q_emb, p_emb = model(q, p)
        loss = contrastive_loss(
            q_emb, p_emb, cfg.retriever.temperature, q_gold, torch.tensor(pids, device=device), strategy.gather_negatives,
            grad_groups=strategy.gradient_groups(step),  # whose gathered passages carry gradients (loss.py)
        )
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(encoder.parameters(), t.grad_clip)
        optim.step()
        sched.step()
        strategy.after_step(params, step)
        if live is not None:
            step_s = time.perf_counter() - step_start
            t0 = time.perf_counter()
            index_metrics = live.after_step(step + 1, encoder.state_dict, measure, step_s, global_batch)
            if index_metrics:
                _emit(index_metrics, step + 1, steps, rank, sink)
            window_t += time.perf_counter() - t0  # staleness probes and snapshots are not training time
            measure_s += time.perf_counter() - t0

        window_n += global_batch
        window_loss += loss.item()  # a sync point, but we need the number for logging anyway
        if (step + 1) % t.log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - window_t
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
            last_bytes, last_comm_s = comm_bytes, comm_s
            t0 = time.perf_counter()
            _emit(metrics, step + 1, steps, rank, sink)  # rank 0's MLflow round trip is not training time
            if config.get("report_intermediate"):  # Tune trials: every rank reports (a barrier in Train V2)
                ray.train.report({"step": step + 1, **metrics})
            measure_s += time.perf_counter() - t0
            window_t, window_n, window_loss = time.perf_counter(), 0, 0.0
        if (cfg.sync.eval_every and (step + 1) % cfg.sync.eval_every == 0) or step + 1 == steps:
            t0 = time.perf_counter()  # every worker takes part (collectives); kept out of the throughput window
            drift = drift_metrics(encoder, params, probe_q, probe_p)
            drift_history.append(drift)
            _emit(drift, step + 1, steps, rank, sink)
            window_t += time.perf_counter() - t0
            measure_s += time.perf_counter() - t0
        if cfg.checkpoint.every_steps and (step + 1) % cfg.checkpoint.every_steps == 0 and step + 1 < steps:
            t0 = time.perf_counter()  # every rank writes its own part; Ray Train merges them into one folder
            with tempfile.TemporaryDirectory() as d:
                save_train_state(d, rank, world, step + 1, encoder, optim, sched, strategy.state_dict(), config["fit_id"])
                ray.train.report({"step": step + 1}, checkpoint=ray.train.Checkpoint.from_directory(d))
            window_t += time.perf_counter() - t0
            measure_s += time.perf_counter() - t0
        maybe_inject_fault(cfg.fault.kill_worker_at_step, cfg.fault.kill_rank, cfg.output_dir, "retriever", rank, step + 1)

    loop_s = time.perf_counter() - loop_start - measure_s
    ran = steps - start_step  # steps of this attempt (after a restart: since the checkpoint)
    if live is not None and rank == 0:
        live.drain()
    summary = {
        "train/samples_per_s": ran * global_batch / loop_s,
        "comm/bytes_per_step": STATS.total_bytes() / ran,
        "comm/time_share": STATS.total_seconds() / loop_s,
        **{f"comm/bytes_per_step/{k}": v / ran for k, v in STATS.bytes.items()},  # grad, params, embeddings, ...
        **strategy.state(),
        **{f"{k}_mean": sum(d[k] for d in drift_history) / len(drift_history) for k in drift_history[0]},
        **(live.summary() if live is not None and rank == 0 else {}),
    }
    strategy.consensus(params)  # replicas -> the consensus model (parameter mean) that gets saved and indexed
    replicas = None
    if strategy.keeps_replicas and world > 1:  # rank 0 collects every replica (vector averaging at index time)
        replicas = [None] * world if rank == 0 else None
        torch.distributed.gather_object({k: v.cpu() for k, v in encoder.state_dict().items()}, replicas, dst=0)
    with tempfile.TemporaryDirectory() as d:
        ckpt = None
        if rank == 0:
            save_weights(encoder.state_dict(), d)
            for r, state in enumerate(replicas or []):
                save_weights(state, d, name=f"replica_{r}")
            # final: a resumed run that finds this checkpoint takes the trained weights instead of training again
            Path(d, "meta.json").write_text(json.dumps({"step": steps, "world": world, "final": True, "summary": summary}))
            ckpt = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"step": steps, **summary}, checkpoint=ckpt)


def _emit(metrics: dict[str, float], step: int, steps: int, rank: int, sink: Optional[MetricSink]) -> None:
    """Rank 0 prints and logs; other ranks stay silent (one process logs)."""
    if rank == 0:
        print(f"[retriever] step {step}/{steps} " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        if sink is not None:
            sink.log(metrics, step)


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
    sink: Optional[MetricSink],
    callbacks: Optional[list] = None,
    report_intermediate: bool = False,
    index_service=None,
    probe: Optional[Probe] = None,
    resume: bool = False,
) -> FitResult:
    """Driver: train the bi-encoder with a TorchTrainer sized by resources.trainer; return the final weights."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    r = cfg.resources.trainer
    steps = total_steps(cfg, len(data.examples))  # fails here, on the driver, if the data is too small
    # Workers may run in another directory: they get the absolute output folder (checkpoint scans, fault markers).
    cfg = replace(cfg, output_dir=str(Path(cfg.output_dir).resolve()))
    storage = Path(cfg.output_dir, "ray")
    start_from, meta = resume_point(storage / "retriever", resume)
    if meta.get("final"):  # training had finished: nothing to redo
        print(f"[retriever] resume: training finished before ({start_from}); using its weights")
        replicas = [load_weights(start_from, p.stem) for p in sorted(start_from.glob("replica_*.safetensors"))]
        return FitResult(load_weights(start_from), meta["summary"], str(start_from), steps, 0.0, replicas)
    if start_from is not None:
        print(f"[retriever] resume from step {meta['step']}: {start_from}")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "cfg": cfg,
            "data_ref": ray.put(data),
            "weights_ref": ray.put(init_weights),
            "sink": sink,
            "report_intermediate": report_intermediate,
            "index_service": index_service,
            "fit_id": uuid.uuid4().hex,  # tags this fit's checkpoints (a restart scans storage for them)
            "resume_from": str(start_from) if start_from is not None else None,  # resume=true: the run's latest
            "probe": probe,
        },
        torch_config=TorchConfig(backend="nccl" if r.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=r.num_workers,
            use_gpu=r.use_gpu,
            resources_per_worker={"CPU": r.cpus_per_worker, **({"GPU": 1} if r.use_gpu else {}), **r.resources},
        ),
        run_config=RunConfig(
            name="retriever",
            storage_path=str(storage),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=cfg.fault.max_failures),
            callbacks=callbacks or None,
            worker_runtime_env={"env_vars": WORKER_ENV},
        ),
    )
    start = time.perf_counter()
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"retriever training finished without a checkpoint (error: {result.error})")
    with result.checkpoint.as_directory() as d:
        weights = load_weights(d)
        replicas = [load_weights(d, p.stem) for p in sorted(Path(d).glob("replica_*.safetensors"))]
    metrics = {k: float(v) for k, v in result.metrics.items() if k != "step"}
    return FitResult(weights, metrics, result.checkpoint.path, steps, time.perf_counter() - start, replicas)


if __name__ == "__main__":  # pragma: no cover - the recipe runs through `python -m ragtrain`
    raise SystemExit("run `python -m ragtrain experiment=NAME`")
