"""Recipe: retrieval-augmented generator fine-tuning on Ray Train workers (gloo on CPU, NCCL on GPU), then EM/F1.

Driver side: `fit_generator` ships the questions/passages and a retrieval client to the training harness
(ragtrain/train/harness.py) and returns rank 0's summary and the final checkpoint. Worker side:
`train_loop_per_worker` reads typed `WorkerArgs` top to bottom: set-up -> train -> evaluate -> save.

Batches are deterministic functions of (seed, step): every rank knows the whole global batch, takes its slice,
and normalises its summed token loss by the GLOBAL target-token count, so N workers x batch b follow the same
loss trajectory as 1 worker x batch N*b (DDP averages gradients over ranks, hence the factor `world`).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from ragtrain.config import Config
from ragtrain.config.generator import GenPrecision
from ragtrain.embed.precision import resolve
from ragtrain.eval.per_question import PER_QUESTION_FILE
from ragtrain.generator.model import build_generator, load_tokenizer
from ragtrain.generator.retriever_client import RetrievalClient
from ragtrain.generator.saved import save_generator
from ragtrain.generator.steps import GenData, Sampler, autocast, evaluate, prompt_builder, step_passages
from ragtrain.track.mlflow import MetricSink
from ragtrain.train.harness import Worker, WorkerArgs, fit, total_steps
from ragtrain.train.schedule import warmup_linear_decay

PREDICTIONS_FILE = "predictions.json"
HISTORY_FILE = "loss_history.json"
METRICS_FILE = "metrics.json"
# the run's results, not part of the model folder (the stage writes the last two next to them)
RUN_FILES = (PREDICTIONS_FILE, HISTORY_FILE, METRICS_FILE, PER_QUESTION_FILE)


@dataclass
class GenReplica:
    """One worker's set-up: the generator (DDP-wrapped on several workers), its optimizer and scaler, the data,
    the retrieval client and the step sampler; `history` holds the logged losses (kept in checkpoints)."""

    args: WorkerArgs
    w: Worker
    data: GenData
    client: RetrievalClient
    model: Any
    ddp: Any
    builder: Any
    targets: list
    params: list
    optim: torch.optim.Optimizer
    sched: Any
    scaler: torch.amp.GradScaler
    sampler: Sampler
    steps: int
    start_step: int
    history: list[dict[str, float]]
    before: dict[str, dict[str, float]]  # generator.eval.before: the scores before fine-tuning (kept in checkpoints)

    @property
    def cfg(self) -> Config:
        return self.args.cfg

    @property
    def global_batch(self) -> int:
        return self.cfg.generator.train.batch_size * self.w.world


@dataclass
class GenInputs:
    """What the generator stage's workers receive beside the config."""

    data: Any  # ObjectRef of the GenData
    retrieval: RetrievalClient  # passages for each question: from the run's index shards


def setup_generator(args: WorkerArgs) -> GenReplica:
    """Build the generator, its optimizer and scaler, restore a checkpoint, wrap it in DDP."""
    cfg = args.cfg
    g, t = cfg.generator, cfg.generator.train
    w = Worker(args, seed=t.seed)  # the same init on every rank (DDP also broadcasts rank 0's weights)
    device = w.device
    resolve(t.precision, device, "generator.train.precision", announce=w.rank == 0)  # auto: said once, by rank 0
    inputs: GenInputs = args.inputs
    data: GenData = w.fetch(inputs.data)
    client: RetrievalClient = inputs.retrieval
    tokenizer = load_tokenizer(g)
    model = build_generator(g, tokenizer).to(device)
    model.train()
    builder = prompt_builder(g, tokenizer)
    targets = [builder.target(e.answers[0], g.max_target_length) for e in data.train]
    steps = total_steps(t.max_steps, t.epochs, len(data.train), t.batch_size * w.world)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    sched = warmup_linear_decay(optim, min(t.warmup_steps, steps - 1) if steps > 1 else 0, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=GenPrecision(t.precision) == GenPrecision.fp16)
    history: list[dict[str, float]] = []
    before: dict[str, dict[str, float]] = {}
    start_step, extra = w.restore(model.hf, optim, sched)
    if start_step:
        scaler.load_state_dict(extra["scaler"])
        history = list(extra["history"])
        before = dict(extra.get("before", {}))
    ddp: torch.nn.Module = model
    if w.world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return GenReplica(args, w, data, client, model, ddp, builder, targets, params, optim, sched, scaler,
                      Sampler(len(data.train), t.seed), steps, start_step, history, before)  # fmt: skip


def step_inputs(r: GenReplica, step: int) -> tuple[list, list, int]:
    """This rank's (sources, targets) of step `step`, the gold passage alone in the curriculum phase, else the
    retrieved ones; and the step's target tokens over every rank (each computes the same number)."""
    g, t, data = r.cfg.generator, r.cfg.generator.train, r.data
    first, per_rank = step * r.global_batch, t.batch_size
    idx = [r.sampler(first + i) for i in range(r.global_batch)]
    mine = range(r.w.rank * per_rank, (r.w.rank + 1) * per_rank)
    exs = [data.train[idx[j]] for j in mine]
    # curriculum phase (the gold passage alone): nothing to retrieve
    curriculum = step < t.oracle_steps
    hits = [[] for _ in exs] if curriculum else r.client.search([e.question for e in exs], g.retrieval.top_k)
    pids = [
        step_passages(
            e, h, step, t, g.retrieval.top_k, random.Random(f"{t.seed}-{first + j}"),
            lambda ps: r.builder.whole_passages(e.question, [data.passages[p] for p in ps]),  # called right here
        )
        for e, h, j in zip(exs, hits, mine)
    ]  # fmt: skip
    src = [r.builder.source(e.question, [data.passages[p] for p in ps]) for e, ps in zip(exs, pids)]
    return src, [r.targets[idx[j]] for j in mine], sum(len(r.targets[i]) for i in idx)


def gen_step(r: GenReplica, src: list, tgt: list, global_tokens: int) -> float:
    """One optimizer step over `grad_accum` micro-batches (all-reduced once); returns the summed token loss."""
    t, device, world = r.cfg.generator.train, r.w.device, r.w.world
    micro = t.batch_size // t.grad_accum
    loss_sum = torch.zeros((), device=device)
    for m in range(t.grad_accum):
        b = r.model.arch.collate(src[m * micro : (m + 1) * micro], tgt[m * micro : (m + 1) * micro], r.model.pad_id)
        b = {k: v.to(device) for k, v in b.items()}
        sync = world == 1 or m == t.grad_accum - 1  # all-reduce once per optimizer step
        with nullcontext() if sync else r.ddp.no_sync(), autocast(t.precision, device):
            s = r.ddp(**b)
        r.scaler.scale(s * (world / global_tokens)).backward()
        loss_sum += s.detach()
    r.scaler.unscale_(r.optim)
    if t.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(r.params, t.grad_clip)
    r.scaler.step(r.optim)
    r.scaler.update()
    r.optim.zero_grad(set_to_none=True)
    r.sched.step()
    return loss_sum.item()


class GenWindow:
    """The metrics of every `generator.train.log_every` steps (gen_train/*: the retriever stage logs train/* into
    the same MLflow run): per-token loss over every rank, tokens and samples per second, lr, retrieval time."""

    def __init__(self, r: GenReplica) -> None:
        self.r = r
        self.loss, self.tokens, self.samples, self.seq_tokens = 0.0, 0, 0, 0

    def add(self, loss: float, global_tokens: int, seq_tokens: int) -> None:
        self.loss += loss
        self.tokens += global_tokens
        self.samples += self.r.global_batch
        self.seq_tokens += seq_tokens

    def log(self, done: int) -> None:
        r = self.r
        elapsed = r.w.window_seconds()
        stats = torch.tensor([self.loss, float(self.seq_tokens)], device=r.w.device, dtype=torch.float64)
        if r.w.world > 1:  # global per-token loss; tokens of every rank
            torch.distributed.all_reduce(stats)
        metrics = {
            "gen_train/loss": stats[0].item() / self.tokens,
            "gen_train/tokens_per_s": stats[1].item() / elapsed,
            "gen_train/samples_per_s": self.samples / elapsed,
            "gen_train/lr": r.sched.get_last_lr()[0],
            "gen_train/retrieval_s": r.client.seconds,
        }
        r.history.append({"step": done, "loss": metrics["gen_train/loss"]})
        r.w.log(metrics, done, r.steps)
        self.loss, self.tokens, self.samples, self.seq_tokens = 0.0, 0, 0, 0


def train_loop_per_worker(args: WorkerArgs) -> None:
    """One Ray Train worker: set up -> train with retrieval in the loop -> evaluate -> save."""
    r = setup_generator(args)
    t, w = r.cfg.generator.train, r.w
    if r.cfg.generator.eval.before and r.start_step == 0:  # the untrained model's EM / F1, same questions and modes
        r.before, _ = evaluate(r.model, r.builder, r.data, r.client, r.cfg, w.device, w.rank, w.world)
    window, run_tokens = GenWindow(r), 0
    loop_start = time.perf_counter()
    w.window_seconds()  # the first log window starts here, after the set-up
    for step in range(r.start_step, r.steps):
        src, tgt, global_tokens = step_inputs(r, step)
        seq_tokens = sum(map(len, src)) + sum(map(len, tgt))  # non-pad tokens through the model
        run_tokens += seq_tokens
        window.add(gen_step(r, src, tgt, global_tokens), global_tokens, seq_tokens)
        done = step + 1
        if done % t.log_every == 0 or done == r.steps:
            window.log(done)
        if t.checkpoint_every and done % t.checkpoint_every == 0 and done < r.steps:
            # every rank writes its own part (RNG states differ)
            last = {"train/loss": r.history[-1]["loss"] if r.history else float("nan")}
            extra = {"scaler": r.scaler.state_dict(), "history": r.history, "before": r.before}
            w.checkpoint(done, r.model.hf, r.optim, r.sched, extra, last)
        w.end_step(done, r.steps)
    finish_generator(r, time.perf_counter() - loop_start - w.measure_s, run_tokens)


def finish_generator(r: GenReplica, loop_s: float, run_tokens: int) -> None:
    """Evaluate (EM/F1 in every retrieval mode), summarise, and save the weights and predictions (rank 0)."""
    w, cfg = r.w, r.cfg
    ran = r.steps - r.start_step  # steps of this attempt (after a restart: since the checkpoint)
    total = torch.tensor([float(run_tokens)], device=w.device, dtype=torch.float64)
    if w.world > 1:
        torch.distributed.all_reduce(total)
    results, predictions = evaluate(r.model, r.builder, r.data, r.client, cfg, w.device, w.rank, w.world)
    summary = {
        "step": r.steps,
        "train/seconds": loop_s,
        "train/samples_per_s": ran * r.global_batch / loop_s,
        "train/tokens_per_s": total.item() / loop_s,
        "train/final_loss": r.history[-1]["loss"],
        "train/retrieval_s": r.client.seconds,
        **{f"{mode}/{k}": v for mode, res in results.items() for k, v in res.items()},
        **{f"before_{mode}/{k}": v for mode, res in r.before.items() for k, v in res.items()},
    }

    def write(folder: Path) -> None:  # rank 0 writes the weights and predictions into the final checkpoint
        weights = save_generator(r.model, r.builder.tok, folder)
        files = {PREDICTIONS_FILE: predictions, HISTORY_FILE: r.history, "meta.json": {"weights": weights.name}}
        for name, obj in files.items():
            Path(folder, name).write_text(json.dumps(obj, indent=1))

    w.finish(summary, write)


@dataclass
class GenFitResult:
    metrics: dict[str, float]  # rank 0's summary: train/*, closed_book/em, rag/f1, ...
    checkpoint_path: str
    steps: int
    seconds: float
    loss_history: list[dict[str, float]]
    predictions: dict[str, list[dict]]


def fit_generator(
    cfg: Config, data: GenData, client: RetrievalClient, sink: MetricSink | None, out_dir: Path | None = None
) -> GenFitResult:
    """Driver: train + evaluate the generator on the harness; copy the final checkpoint's files to out_dir."""
    r, t = cfg.resources.trainer, cfg.generator.train
    if not data.train:
        raise ValueError("the generator stage has no training questions with answers")
    args = WorkerArgs(
        cfg,
        "generator",
        cpus_per_worker=t.cpus_per_worker or r.cpus_per_worker,
        sink=sink,
        inputs=GenInputs(ray.put(data), client),
    )
    done = fit(train_loop_per_worker, args, num_workers=t.num_workers or r.num_workers)
    return _result(done.folder, done.summary, out_dir, done.seconds, done.checkpoint_path)


def _result(
    folder: Path, summary: dict[str, Any], out_dir: Path | None, seconds: float, path: str | None = None
) -> GenFitResult:
    """The fit's result from its final checkpoint folder; its files are copied to out_dir."""
    predictions = json.loads(Path(folder, PREDICTIONS_FILE).read_text())
    history = json.loads(Path(folder, HISTORY_FILE).read_text())
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in Path(folder).iterdir():
            if f.name != "meta.json":
                shutil.copy2(f, out_dir / f.name)
    metrics = {k: float(v) for k, v in summary.items() if k != "step"}
    return GenFitResult(metrics, path or str(folder), int(summary["step"]), seconds, history, predictions)
