"""Recipe: the retriever and the generator trained together in one Ray Train job (gloo on CPU, NCCL on GPU).

Driver side: `fit_joint` ships the questions, the initial encoder and the run's index (frozen passage encoder) or
its live refresh service (trained passage encoder) to the training harness (ragtrain/train/harness.py). Worker
side, `train_loop_per_worker`, top to bottom, per step:
  1. the question encoder being trained encodes this rank's questions; the index (the shard group, or the live
     index behind the refresh service) gives each its top `joint.top_k` passages;
  2. the generator scores each (question, passage) pair: log p(answer | question, passage), a detached target;
  3. the retriever's scores of the k passages are recomputed with grad (query vectors from the trained encoder;
     passage vectors re-encoded by the trained encoder, or by a frozen copy of the initial one) and `joint.loss`
     pulls its softmax towards the generator's; the generator's own NLL on the answer given its top passages is
     added; one backward, one DDP all-reduce over both models;
  4. trained passage encoder: the live refresh client (index/live_client.py) measures staleness and starts refreshes.
Then EM / F1 (generator/steps.py's `evaluate`, retrieving with the trained query encoder) and the weights saved.

Batches are deterministic functions of (seed, step): every rank knows the whole global batch and takes its slice;
the retriever loss is a mean per question and the generator's summed token loss is normalised by the GLOBAL
target-token count, so N workers x batch b follow 1 worker x batch N*b (DDP averages over ranks).
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from ragtrain.config import Config
from ragtrain.config.joint import PassageEncoder
from ragtrain.embed.model import BiEncoder, build_encoder, encode_texts, tokenize
from ragtrain.embed.model import load_tokenizer as load_encoder_tokenizer
from ragtrain.embed.weights import load_state, load_weights, save_weights
from ragtrain.generator.model import GenModel, build_generator, load_tokenizer
from ragtrain.generator.saved import save_generator
from ragtrain.generator.steps import GenData, GenExample, Sampler, autocast, evaluate, prompt_builder, step_passages
from ragtrain.index.live_client import LiveIndexClient, Probe, staleness
from ragtrain.joint import GENERATOR_FOLDER
from ragtrain.joint.likelihood import answer_loglik
from ragtrain.joint.losses.base import build_loss
from ragtrain.track.mlflow import MetricSink
from ragtrain.train.harness import Worker, WorkerArgs, fit
from ragtrain.train.schedule import warmup_linear_decay

HISTORY_FILE = "loss_history.json"
PREDICTIONS_FILE = "predictions.json"


@dataclass
class JointData:
    """The generator's questions and prompt texts, and the encoder's passage texts by index row."""

    gen: GenData
    doc_ids: list[str]  # corpus order: the live index's rows (refresh service) are positions in it
    encoder_texts: Sequence[str]  # the encoder's input text of each passage, in corpus order
    positions: Mapping[str, int]  # doc id -> corpus position


@dataclass
class JointInputs:
    """What the joint stage's workers receive beside the config."""

    data: Any  # ObjectRef of the JointData
    weights: Any  # ObjectRef of the encoder snapshot that built the index (every rank starts from it)
    index: Any  # the run's index (its shard actors): searched when the passage encoder is frozen
    service: Any = None  # the live refresh service (joint.passage_encoder=trained): searched instead
    probe: Probe | None = None  # the staleness probe (with the service)


class JointModel(nn.Module):
    """The bi-encoder and the generator as ONE module: DDP sees one forward (query vectors, passage vectors when
    they are trained, the generator's summed answer NLL) per backward, and all-reduces both models' gradients."""

    def __init__(self, encoder: BiEncoder, generator: GenModel):
        super().__init__()
        self.encoder, self.generator = encoder, generator

    def forward(
        self, q: dict[str, torch.Tensor], p: dict[str, torch.Tensor] | None, gen: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        return self.encoder(**q), (None if p is None else self.encoder(**p)), self.generator(**gen)


class IndexSearch:
    """Top-k passage ids from the live index for question texts, with the trained query encoder; the generator's
    `evaluate` uses it too (its `search(questions, k)` interface)."""

    def __init__(self, r: JointReplica):
        self.r = r
        self.seconds = 0.0

    def vectors(self, questions: Sequence[str]) -> np.ndarray:
        r, rc = self.r, self.r.cfg.retriever
        enc = r.model.encoder
        return encode_texts(enc, r.enc_tok, questions, rc.query_max_length, 64, rc.train.precision, r.w.device,
                            role="query").numpy()  # fmt: skip

    def search(self, questions: Sequence[str], k: int) -> list[list[str]]:
        start = time.perf_counter()
        qv = self.vectors(questions)
        inputs: JointInputs = self.r.args.inputs
        if inputs.service is not None:  # the live index: rows are corpus positions (counted as hot rows there)
            _, rows = ray.get(inputs.service.search.remote(qv, k))
            ids = [[self.r.data.doc_ids[x] for x in row if x >= 0] for row in rows]
        else:
            ids = inputs.index.search_ids(qv, k)
        self.seconds += time.perf_counter() - start
        return ids


@dataclass
class JointReplica:
    """One worker's set-up: both models (one DDP module), the optimizer, the data, the index and its refresh."""

    args: WorkerArgs
    w: Worker
    data: JointData
    model: JointModel
    ddp: nn.Module
    frozen: BiEncoder | None  # joint.passage_encoder=frozen: the initial encoder, for the passage side
    enc_tok: Any
    builder: Any
    targets: list  # generator target ids per training question
    optim: torch.optim.Optimizer
    sched: Any
    sampler: Sampler
    steps: int
    loss: Any
    live: LiveIndexClient | None
    search: Any = None  # IndexSearch
    measure: Any = None  # rank 0 with a live refresh: the current encoder on the staleness probe

    @property
    def cfg(self) -> Config:
        return self.args.cfg

    @property
    def global_batch(self) -> int:
        return self.cfg.joint.batch_size * self.w.world


def setup(args: WorkerArgs) -> JointReplica:
    """Both models from the same seed on every rank, one optimizer (one lr per model), DDP, the live client."""
    cfg = args.cfg
    j, g = cfg.joint, cfg.generator
    w = Worker(args, seed=j.seed)  # the same init on every rank (DDP also broadcasts rank 0's weights)
    inputs: JointInputs = args.inputs
    data: JointData = w.fetch(inputs.data)
    encoder = build_encoder(cfg.retriever)
    load_state(encoder, w.fetch(inputs.weights))
    frozen = None
    if PassageEncoder(j.passage_encoder) == PassageEncoder.frozen:  # the encoder of the stored passage vectors
        frozen = copy.deepcopy(encoder).to(w.device).eval().requires_grad_(False)
    gen_tok = load_tokenizer(g)
    generator = build_generator(g, gen_tok)
    model = JointModel(encoder, generator).to(w.device).train()
    ddp: nn.Module = model
    if w.world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[w.device.index] if w.device.type == "cuda" else None
        )
    builder = prompt_builder(g, gen_tok)
    targets = [builder.target(e.answers[0], g.max_target_length) for e in data.gen.train]
    steps = j.max_steps
    optim = torch.optim.AdamW(
        [
            {"params": [p for p in encoder.parameters() if p.requires_grad], "lr": j.retriever_lr},
            {"params": [p for p in generator.parameters() if p.requires_grad], "lr": g.train.lr},
        ],
        weight_decay=g.train.weight_decay,
    )
    sched = warmup_linear_decay(optim, min(g.train.warmup_steps, steps - 1) if steps > 1 else 0, steps)
    live = None
    if inputs.service is not None:  # reuse the retriever's live client: one version per step, refresh schedule
        live = LiveIndexClient(inputs.service, cfg.refresh, w.rank, broadcast=w.world > 1, device=w.device)
    loss = build_loss(j)
    r = JointReplica(args, w, data, model, ddp, frozen, load_encoder_tokenizer(cfg.retriever), builder, targets,
                     optim, sched, Sampler(len(data.gen.train), j.seed), steps, loss, live)  # fmt: skip
    r.search = IndexSearch(r)
    if live is not None and inputs.probe is not None:
        probe = inputs.probe
        texts = [data.encoder_texts[i] for i in probe.rows]

        def measure(stale: np.ndarray) -> dict[str, float]:
            rc = cfg.retriever
            p = encode_texts(encoder, r.enc_tok, texts, rc.passage_max_length, 64, rc.train.precision, w.device,
                             role="passage")  # fmt: skip
            return staleness(stale, p.numpy(), r.search.vectors(probe.queries), probe.gold)

        r.measure = measure
    return r


def step_batch(r: JointReplica, step: int) -> tuple[list[GenExample], list[list[str]], list, list, int]:
    """This rank's questions of step `step`, each one's top-k passage ids from the live index, the generator's
    (sources, targets) with its top passages, and the step's target tokens over every rank."""
    j, g, t = r.cfg.joint, r.cfg.generator, r.cfg.generator.train
    first = step * r.global_batch
    idx = [r.sampler(first + i) for i in range(r.global_batch)]
    mine = list(range(r.w.rank * j.batch_size, (r.w.rank + 1) * j.batch_size))
    exs = [r.data.gen.train[idx[m]] for m in mine]
    hits = r.search.search([e.question for e in exs], j.top_k)
    short = [e.qid for e, h in zip(exs, hits) if len(h) < j.top_k]
    if short:
        raise RuntimeError(f"the index returned fewer than joint.top_k={j.top_k} passages for {short[:3]}")
    passages = r.data.gen.passages
    pids = [  # the generator's own prompt passages (its gold-only curriculum included)
        step_passages(
            e, h, step, t, g.retrieval.top_k, random.Random(f"{j.seed}-{first + m}"),
            lambda ps: r.builder.whole_passages(e.question, [passages[p] for p in ps]),  # called right here
        )
        for e, h, m in zip(exs, hits, mine)
    ]  # fmt: skip
    src = [r.builder.source(e.question, [passages[p] for p in ps]) for e, ps in zip(exs, pids)]
    tgt = [r.targets[idx[m]] for m in mine]
    return exs, hits, src, tgt, sum(len(r.targets[i]) for i in idx)


def joint_step(r: JointReplica, step: int) -> dict[str, float]:
    """One optimizer step over both models; returns this rank's retriever loss, summed token NLL, and the
    generator's posterior mass on the retriever's top passage (how much the two agree)."""
    cfg, j, device, world = r.cfg, r.cfg.joint, r.w.device, r.w.world
    rc, gen = cfg.retriever, r.model.generator
    exs, hits, src, tgt, global_tokens = step_batch(r, step)
    questions = [e.question for e in exs]
    passages = r.data.gen.passages
    gen.eval()  # the target without dropout: a stable distribution to distil (and the same on every world size)
    # in the training precision, like the rest of the step: k single-passage prompts per question are its largest
    # forward (log-softmax still runs in fp32 under autocast)
    with autocast(cfg.generator.train.precision, device):
        loglik = answer_loglik(gen, r.builder, questions, [[passages[p] for p in h] for h in hits],
                               [e.answers[0] for e in exs], cfg.generator.max_target_length).float()  # fmt: skip
    gen.train()
    texts = [r.data.encoder_texts[r.data.positions[p]] for h in hits for p in h]
    q = {k: v.to(device) for k, v in tokenize(r.enc_tok, questions, rc.query_max_length, "query").items()}
    p = {k: v.to(device) for k, v in tokenize(r.enc_tok, texts, rc.passage_max_length, "passage").items()}
    g = {k: v.to(device) for k, v in gen.arch.collate(src, tgt, gen.pad_id).items()}
    with autocast(cfg.generator.train.precision, device):
        q_emb, p_emb, nll = r.ddp(q, None if r.frozen is not None else p, g)
    if r.frozen is not None:  # query side only: the passage vectors are the frozen encoder's (the index's)
        with torch.no_grad():
            p_emb = r.frozen(**p)
    scores = (q_emb.float().unsqueeze(1) * p_emb.float().view(len(exs), j.top_k, -1)).sum(-1)
    retriever_loss = r.loss(scores, loglik)
    gen_loss = nll * (world / global_tokens)
    (j.retriever_weight * retriever_loss + j.generator_weight * gen_loss).backward()
    clip = cfg.generator.train.grad_clip
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(r.model.parameters(), clip)
    r.optim.step()
    r.optim.zero_grad(set_to_none=True)
    r.sched.step()
    top_mass = torch.softmax(loglik / j.temperature, -1).gather(1, scores.argmax(1, keepdim=True)).mean()
    return {"retriever_loss": retriever_loss.item(), "nll": nll.item(), "top_mass": top_mass.item()}


class Window:
    """The metrics of every `joint.log_every` steps over every rank: the joint loss, the generator's per-token
    loss, how much of the generator's posterior the retriever's top passage holds, samples per second."""

    def __init__(self, r: JointReplica):
        self.r = r
        self.sums = np.zeros(4)  # retriever loss, nll, top mass, steps
        self.tokens = 0

    def add(self, m: dict[str, float], global_tokens: int) -> None:
        self.sums += [m["retriever_loss"], m["nll"], m["top_mass"], 1]
        self.tokens += global_tokens

    def log(self, done: int, history: list[dict[str, float]]) -> None:
        r, j = self.r, self.r.cfg.joint
        elapsed = r.w.window_seconds()
        s = torch.tensor(self.sums[:3], dtype=torch.float64, device=r.w.device)  # NCCL reduces device tensors
        if r.w.world > 1:
            torch.distributed.all_reduce(s)
        n = self.sums[3]
        metrics = {
            f"joint/{j.loss}_loss": s[0].item() / (n * r.w.world),
            "joint/gen_loss": s[1].item() / self.tokens,
            "joint/top_passage_posterior": s[2].item() / (n * r.w.world),
            "joint/samples_per_s": n * r.global_batch / elapsed,
            "joint/lr_retriever": r.sched.get_last_lr()[0],
            "joint/retrieval_s": r.search.seconds,
        }
        metrics["joint/loss"] = j.retriever_weight * metrics[f"joint/{j.loss}_loss"]
        metrics["joint/loss"] += j.generator_weight * metrics["joint/gen_loss"]
        history.append({"step": done, **{k.removeprefix("joint/"): v for k, v in metrics.items()}})
        r.w.log(metrics, done, r.steps)
        self.sums[:] = 0
        self.tokens = 0


def train_loop_per_worker(args: WorkerArgs) -> None:
    """One Ray Train worker: set up -> joint steps (with the live refresh's upkeep) -> evaluate -> save."""
    r = setup(args)
    w, j = r.w, r.cfg.joint
    window = Window(r)
    history: list[dict[str, float]] = []
    loop_start = time.perf_counter()
    w.window_seconds()
    for step in range(r.steps):
        step_start = time.perf_counter()
        if r.live is not None:
            r.live.begin_step(step)  # every rank records the version it trains against (one per step)
        first = step * r.global_batch
        global_tokens = sum(len(r.targets[r.sampler(first + i)]) for i in range(r.global_batch))
        window.add(joint_step(r, step), global_tokens)
        done = step + 1
        if r.live is not None:
            with w.not_training():  # staleness probes and snapshots are not training time
                index_metrics = r.live.after_step(
                    done, r.model.encoder.state_dict, r.measure, time.perf_counter() - step_start, r.global_batch
                )
            if index_metrics:
                w.log(index_metrics, done, r.steps)
        if done % j.log_every == 0 or done == r.steps:
            window.log(done, history)
        w.end_step(done, r.steps)
    finish(r, time.perf_counter() - loop_start - w.measure_s, history)


def finish(r: JointReplica, loop_s: float, history: list[dict[str, float]]) -> None:
    """Drain the refresh, evaluate EM / F1 with the trained query encoder, save the encoder and the generator."""
    w = r.w
    refresh: dict[str, float] = {}
    if r.live is not None and w.rank == 0:
        drained = r.live.drain()  # a refresh still running: its metrics at the last step
        if drained:
            w.log(drained, r.steps, r.steps)
        refresh = r.live.summary()
    results, predictions = evaluate(r.model.generator, r.builder, r.data.gen, r.search, r.cfg, w.device, w.rank,
                                    w.world)  # fmt: skip
    summary = {
        "step": r.steps,
        "train/seconds": loop_s,
        "train/samples_per_s": r.steps * r.global_batch / loop_s,
        "train/final_loss": history[-1]["loss"],
        **refresh,
        **{f"{mode}/{k}": v for mode, res in results.items() for k, v in res.items()},
    }

    def write(folder: Path) -> None:  # rank 0: both models and the run's curves into the final checkpoint
        save_weights(r.model.encoder.state_dict(), folder)
        save_generator(r.model.generator, r.builder.tok, folder / GENERATOR_FOLDER)
        Path(folder, HISTORY_FILE).write_text(json.dumps(history, indent=1))
        Path(folder, PREDICTIONS_FILE).write_text(json.dumps(predictions, indent=1))

    w.finish(summary, write)


@dataclass
class JointResult:
    weights: dict[str, torch.Tensor]  # the trained encoder
    metrics: dict[str, float]  # rank 0's summary: train/*, index/* (trained passages), rag/em, ...
    folder: Path  # the final checkpoint: encoder.safetensors, generator/, loss_history.json, predictions.json
    history: list[dict[str, float]]
    seconds: float


def fit_joint(
    cfg: Config,
    data: JointData,
    weights: dict[str, torch.Tensor],
    index: Any,
    sink: MetricSink | None,
    service: Any = None,
    probe: Probe | None = None,
) -> JointResult:
    """Driver: joint training on the harness with resources.trainer workers; returns the trained encoder."""
    r = cfg.resources.trainer
    if len(data.gen.train) < cfg.joint.batch_size * r.num_workers:
        raise ValueError(
            f"{len(data.gen.train)} training questions < one global batch of joint.batch_size x num_workers "
            f"({cfg.joint.batch_size} x {r.num_workers}): lower joint.batch_size"
        )
    inputs = JointInputs(ray.put(data), ray.put(weights), index, service, probe)
    args = WorkerArgs(cfg, "joint", cpus_per_worker=r.cpus_per_worker, sink=sink, inputs=inputs)
    done = fit(train_loop_per_worker, args, num_workers=r.num_workers)
    history = json.loads(Path(done.folder, HISTORY_FILE).read_text())
    metrics = {k: float(v) for k, v in done.summary.items() if k != "step"}
    return JointResult(load_weights(done.folder), metrics, done.folder, history, done.seconds)
