"""Recipe: the cross-encoder teacher, trained listwise on the training split on Ray Train workers.

Each query of a step is scored against its positive and `retriever.teacher.negatives` of its mined hard negatives
(the same deterministic, worker-count-invariant batches as the bi-encoder: `local_batch`), and the loss is the
cross-entropy of the positive among them (the usual reranker objective). DDP averages the workers' gradients.
Driver side: `fit_teacher` runs it on the harness and saves the model with its tokenizer to <output_dir>/teacher.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ragtrain.config import Config
from ragtrain.embed.model import load_tokenizer
from ragtrain.reranker.model import build_cross_encoder, pair_inputs, save_teacher
from ragtrain.retriever.batching import TrainData, local_batch, query_candidates
from ragtrain.runtime.console import get_logger
from ragtrain.track.mlflow import MetricSink
from ragtrain.train.harness import Worker, WorkerArgs, fit, total_steps
from ragtrain.train.schedule import warmup_linear_decay

log = get_logger(__name__)
TEACHER_DIR = "teacher"


@dataclass
class TeacherInputs:
    """What the teacher stage's workers receive beside the config."""

    data: Any  # ObjectRef of the TrainData


def train_loop_per_worker(args: WorkerArgs) -> None:
    """One Ray Train worker: set up -> train listwise -> save the final model."""
    cfg = args.cfg
    tc, seed = cfg.retriever.teacher, cfg.retriever.train.seed
    w = Worker(args, seed=seed)  # the same head init on every rank (DDP broadcasts rank 0's anyway)
    device, rank, world = w.device, w.rank, w.world
    data: TrainData = w.fetch(args.inputs.data)
    model = build_cross_encoder(cfg.retriever).to(device).train()
    tokenizer = load_tokenizer(cfg.retriever)
    global_batch = tc.batch_size * world
    steps = total_steps(tc.max_steps, tc.epochs, len(data.examples), global_batch)
    optim = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=0.01)
    sched = warmup_linear_decay(optim, int(0.1 * steps), steps)
    start_step, _ = w.restore(model, optim, sched)
    ddp = (
        torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if world > 1
        else model
    )

    log_every = cfg.retriever.train.log_every
    win_loss, win_acc, win_n = 0.0, 0.0, 0
    loop_start = time.perf_counter()
    w.window_seconds()
    for step in range(start_step, steps):
        queries, pids, _ = local_batch(data, global_batch, step, seed, rank, world, tc.negatives, None, "random")
        b, h = len(queries), tc.negatives
        lists = query_candidates(pids, b, h)  # the positive first
        enc = pair_inputs(
            tokenizer,
            [q for q in queries for _ in range(1 + h)],
            [data.passages[p] for cand in lists for p in cand],
            tc.max_length,
        )
        logits = ddp(**{k: v.to(device) for k, v in enc.items()}).logits.view(b, 1 + h)
        target = torch.zeros(b, dtype=torch.long, device=device)
        loss = F.cross_entropy(logits, target)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        done = step + 1
        win_loss += loss.item()
        win_acc += (logits.argmax(1) == 0).float().mean().item()  # the positive ranked first among its list
        win_n += 1
        if done % log_every == 0 or done == steps:
            elapsed = w.window_seconds()
            w.log(
                {
                    "teacher/loss": win_loss / win_n,
                    "teacher/train_top1": win_acc / win_n,
                    "teacher/queries_per_s": win_n * global_batch / elapsed,
                },
                done,
                steps,
            )
            win_loss, win_acc, win_n = 0.0, 0.0, 0
        if cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0 and done < steps:
            w.checkpoint(done, model, optim, sched, {})
        w.end_step(done, steps)

    loop_s = time.perf_counter() - loop_start - w.measure_s
    ran = max(1, steps - start_step)
    summary = {"step": steps, "teacher/queries_per_s": ran * global_batch / max(loop_s, 1e-9)}
    w.finish(summary, lambda folder: model.save_pretrained(folder))


def fit_teacher(cfg: Config, data: TrainData, sink: MetricSink | None) -> tuple[Path, dict[str, float]]:
    """Driver: train the teacher on resources.trainer workers; returns (<output_dir>/teacher, summary)."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    r, tc = cfg.resources.trainer, cfg.retriever.teacher
    steps = total_steps(tc.max_steps, tc.epochs, len(data.examples), tc.batch_size * r.num_workers)  # fails here
    inputs = TeacherInputs(ray.put(data))
    args = WorkerArgs(cfg, "teacher", cpus_per_worker=r.cpus_per_worker, sink=sink, inputs=inputs)
    log.info(f"[teacher] training a cross-encoder from {cfg.retriever.model}: {steps} steps on {r.num_workers} workers")
    done = fit(train_loop_per_worker, args, num_workers=r.num_workers)

    model = build_cross_encoder(cfg.retriever, done.folder)  # the final checkpoint holds save_pretrained's files
    out = Path(cfg.output_dir) / TEACHER_DIR
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_teacher(model, cfg.retriever, tmp, {"steps": steps, "train_queries": len({e.qidx for e in data.examples})})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a teacher folder is complete or absent
    summary = {k: float(v) for k, v in done.summary.items() if k != "step"}
    return out, {**summary, "steps": float(steps), "seconds": done.seconds}
