"""Recipe: the retriever and the generator trained together in one Ray Train job (gloo on CPU, NCCL on GPU).

Driver side: `fit_joint` ships the questions, the initial encoder and the run's index (frozen passage encoder) or
its live refresh service (trained passage encoder) to the training harness (ragtrain/train/harness.py). Worker
side, `train_loop_per_worker`, top to bottom, per step:
  1. the question encoder being trained encodes this rank's questions; the index (the shard group, or the live
     index behind the refresh service: one search by rank 0 for every rank, so a step reads one index version)
     gives each its top `joint.top_k` passages;
  2. the generator scores each (question, passage) pair: log p(answer | question, passage), a detached target;
  3. the retriever's scores of the k passages are recomputed with grad (query vectors from the trained encoder;
     passage vectors re-encoded by the trained encoder, or by a frozen copy of the initial one) and `joint.loss`
     pulls its softmax towards the generator's; the generator's own NLL on the answer given its top passages is
     added; one backward, one DDP all-reduce over both models;
  4. trained passage encoder: the live refresh client (index/live_client.py) measures staleness and starts refreshes;
  5. every `checkpoint.every_steps`: both models, the optimizer (a parameter group per model) and its schedule,
     the RNG states, the loss history and the live index's newest version (`Worker.checkpoint`); a restarted or
     resumed worker continues from it (`Worker.restore`).
Then EM / F1 (generator/steps.py's `evaluate`, retrieving with the trained query encoder) and the weights saved.
With a trained passage encoder the RAG figures here read the live index and are reported as `live/rag/*`: the
stage re-encodes the corpus and scores RAG again on the index it ships (joint/evaluate.py).

Batches are deterministic functions of (seed, step): every rank knows the whole global batch and takes its slice
(the data position of a checkpoint is its step);
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
from safetensors.torch import load_file
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
from ragtrain.joint.optim import build_optimizer, clip_and_step
from ragtrain.track.mlflow import MetricSink
from ragtrain.train.checkpoint import CheckpointError
from ragtrain.train.harness import Worker, WorkerArgs, fit

HISTORY_FILE = "loss_history.json"
PREDICTIONS_FILE = "predictions.json"
LIVE = "live/"  # trained passages: the training fit's RAG figures, read from the live index (not the one shipped)


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
    """Top-k passage ids for question texts with the trained query encoder: from the run's index (its shard actors;
    the shipped one in joint/evaluate.py) or the live index behind the refresh service. The generator's `evaluate`
    uses `search` (each rank alone); a training step `search_step` (with the live index: one version per step)."""

    def __init__(
        self, cfg: Config, encoder: BiEncoder, tokenizer: Any, device: torch.device, doc_ids: list[str],
        index: Any = None, service: Any = None,
    ) -> None:  # fmt: skip
        self.cfg, self.encoder, self.tokenizer, self.device = cfg, encoder, tokenizer, device
        self.doc_ids, self.index, self.service = doc_ids, index, service
        self.seconds = 0.0

    def vectors(self, questions: Sequence[str]) -> np.ndarray:
        rc = self.cfg.retriever
        return encode_texts(self.encoder, self.tokenizer, questions, rc.query_max_length, 64, rc.train.precision,
                            self.device, role="query").numpy()  # fmt: skip

    def _ids(self, rows: np.ndarray) -> list[list[str]]:
        """The live index's rows are corpus positions (counted as hot rows there)."""
        return [[self.doc_ids[x] for x in row if x >= 0] for row in rows]

    def search(self, questions: Sequence[str], k: int) -> list[list[str]]:
        return self.search_scored(questions, k)[0]

    def search_scored(self, questions: Sequence[str], k: int) -> tuple[list[list[str]], list[list[float]]]:
        """Top-k passage ids and their scores (the answer likelihood's p_R reads them)."""
        start = time.perf_counter()
        qv = self.vectors(questions)
        if self.service is not None:  # the live index: rows are corpus positions (counted as hot rows there)
            scores, rows = ray.get(self.service.search.remote(qv, k))
            ids = self._ids(rows)
        else:
            scores, rows = self.index.search(qv, k)
            ids = [[self.index.doc_ids[x] for x in row if x >= 0] for row in rows]
        self.seconds += time.perf_counter() - start
        return ids, [[float(v) for v, x in zip(srow, row) if x >= 0] for srow, row in zip(scores, rows)]

    def search_step(self, questions: Sequence[str], k: int, live: LiveIndexClient | None) -> list[list[str]]:
        """A training step's hits. The live index changes under a refresh: rank 0 searches every rank's questions
        at once, so every rank of the step reads the version that search read (`LiveIndexClient.search_step`)."""
        if live is None:  # the run's index: it never changes
            return self.search(questions, k)
        start = time.perf_counter()
        ids = self._ids(live.search_step(self.vectors(questions), k))
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
    start_step: int  # 0, or the step of the checkpoint a restarted or resumed worker continues from
    history: list[dict[str, float]]  # every logged window (kept in checkpoints: loss_history.json is the run's)
    loss: Any
    live: LiveIndexClient | None
    search: IndexSearch
    measure: Any = None  # rank 0 with a live refresh: the current encoder on the staleness probe

    @property
    def cfg(self) -> Config:
        return self.args.cfg

    @property
    def global_batch(self) -> int:
        return self.cfg.joint.batch_size * self.w.world


def setup(args: WorkerArgs) -> JointReplica:
    """Both models from the same seed on every rank, one optimizer (a parameter group per model), a checkpoint
    restored (a restart, or resume=true), DDP, the live client."""
    cfg = args.cfg
    j, g = cfg.joint, cfg.generator
    w = Worker(args, seed=j.seed)  # the same init on every rank (DDP also broadcasts rank 0's weights)
    inputs: JointInputs = args.inputs
    data: JointData = w.fetch(inputs.data)
    encoder = build_encoder(cfg.retriever)
    load_state(encoder, w.fetch(inputs.weights))
    frozen = None
    if PassageEncoder(j.passage_encoder) == PassageEncoder.frozen:  # the encoder of the stored passage vectors
        frozen = copy.deepcopy(encoder).to(w.device).eval().requires_grad_(False)  # before a restore: the initial one
    gen_tok = load_tokenizer(g)
    generator = build_generator(g, gen_tok)
    model = JointModel(encoder, generator).to(w.device).train()
    steps = j.max_steps
    optim, sched = build_optimizer(encoder, generator, cfg, steps)  # each model its own lr, decay, warm-up, clip
    # before DDP, which broadcasts rank 0's weights: every rank restores the same ones anyway
    start_step, extra = w.restore(model, optim, sched)
    ddp: nn.Module = model
    if w.world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[w.device.index] if w.device.type == "cuda" else None
        )
    builder = prompt_builder(g, gen_tok)
    targets = [builder.target(e.answers[0], g.max_target_length) for e in data.gen.train]
    live = None
    if inputs.service is not None:  # reuse the retriever's live client: one version per step, refresh schedule
        live = LiveIndexClient(inputs.service, cfg.refresh, w.rank, broadcast=w.world > 1, device=w.device)
    enc_tok = load_encoder_tokenizer(cfg.retriever)
    search = IndexSearch(cfg, encoder, enc_tok, w.device, data.doc_ids, inputs.index, inputs.service)
    r = JointReplica(args, w, data, model, ddp, frozen, enc_tok, builder, targets, optim, sched,
                     Sampler(len(data.gen.train), j.seed), steps, start_step, list(extra.get("history", [])),
                     build_loss(j), live, search)  # fmt: skip
    if live is not None and inputs.probe is not None:
        r.measure = probe_measure(r, inputs.probe)
    return r


def probe_measure(r: JointReplica, probe: Probe) -> Any:
    """Rank 0's staleness measure: the current encoder's vectors of the probe's passages and queries against the
    live version's stored ones."""
    texts = [r.data.encoder_texts[i] for i in probe.rows]
    rc = r.cfg.retriever

    def measure(stale: np.ndarray) -> dict[str, float]:
        p = encode_texts(r.model.encoder, r.enc_tok, texts, rc.passage_max_length, 64, rc.train.precision,
                         r.w.device, role="passage")  # fmt: skip
        return staleness(stale, p.numpy(), r.search.vectors(probe.queries), probe.gold)

    return measure


def step_batch(r: JointReplica, step: int) -> tuple[list[GenExample], list[list[str]], list, list, int]:
    """This rank's questions of step `step`, each one's top-k passage ids from the live index, the generator's
    (sources, targets) with its top passages, and the step's target tokens over every rank."""
    j, g, t = r.cfg.joint, r.cfg.generator, r.cfg.generator.train
    first = step * r.global_batch
    idx = [r.sampler(first + i) for i in range(r.global_batch)]
    mine = list(range(r.w.rank * j.batch_size, (r.w.rank + 1) * j.batch_size))
    exs = [r.data.gen.train[idx[m]] for m in mine]
    hits = r.search.search_step([e.question for e in exs], j.top_k, r.live)
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
    norms = clip_and_step(r.optim, r.sched)  # each model clipped by its own norm (joint/optim.py)
    top_mass = torch.softmax(loglik / j.temperature, -1).gather(1, scores.argmax(1, keepdim=True)).mean()
    return {"retriever_loss": retriever_loss.item(), "nll": nll.item(), "top_mass": top_mass.item(), **norms}


class Window:
    """The metrics of every `joint.log_every` steps over every rank: the joint loss, the generator's per-token
    loss, how much of the generator's posterior the retriever's top passage holds, samples per second."""

    def __init__(self, r: JointReplica):
        self.r = r
        self.sums = np.zeros(4)  # retriever loss, nll, top mass, steps
        self.norms = np.zeros(2)  # each model's gradient norm before clipping (the same on every rank: all-reduced)
        self.tokens = 0

    def add(self, m: dict[str, float], global_tokens: int) -> None:
        self.sums += [m["retriever_loss"], m["nll"], m["top_mass"], 1]
        self.norms += [m["grad_norm/retriever"], m["grad_norm/generator"]]
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
            "joint/lr_generator": r.sched.get_last_lr()[1],
            "joint/grad_norm_retriever": self.norms[0] / n,
            "joint/grad_norm_generator": self.norms[1] / n,
            "joint/retrieval_s": r.search.seconds,
        }
        metrics["joint/loss"] = j.retriever_weight * metrics[f"joint/{j.loss}_loss"]
        metrics["joint/loss"] += j.generator_weight * metrics["joint/gen_loss"]
        # plain floats: the history goes into checkpoints, which load plain values only (weights_only)
        history.append({"step": done, **{k.removeprefix("joint/"): float(v) for k, v in metrics.items()}})
        r.w.log(metrics, done, r.steps)
        self.sums[:] = 0
        self.norms[:] = 0
        self.tokens = 0


def train_loop_per_worker(args: WorkerArgs) -> None:
    """One Ray Train worker: set up -> joint steps (with the live refresh's upkeep and the checkpoints) -> evaluate
    -> save."""
    r = setup(args)
    w, j, every = r.w, r.cfg.joint, r.cfg.checkpoint.every_steps
    window = Window(r)
    loop_start = time.perf_counter()
    w.window_seconds()
    for step in range(r.start_step, r.steps):
        step_start = time.perf_counter()
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
            window.log(done, r.history)
        if every and done % every == 0 and done < r.steps:
            save_checkpoint(r, done)
        w.end_step(done, r.steps)
    finish(r, time.perf_counter() - loop_start - w.measure_s)


def save_checkpoint(r: JointReplica, done: int) -> None:
    """Every rank: both models (one file), the optimizer's two groups and their schedule, the RNG states
    (`Worker.checkpoint`) and the loss history; rank 0 adds the live index's newest version (a resumed run's live
    index numbers on from it). The data position is the step: batches are a function of (seed, step).
    checkpoint.every_steps is a multiple of joint.log_every, so no loss window is cut by a restart."""
    info = r.live.checkpoint_info() if r.live is not None else {}
    r.w.checkpoint(done, r.model, r.optim, r.sched, {"history": r.history}, {"joint/loss": r.history[-1]["loss"]}, info)


def finish(r: JointReplica, loop_s: float) -> None:
    """Drain the refresh, evaluate EM / F1 with the trained query encoder, save the encoder and the generator."""
    w = r.w
    refresh: dict[str, float] = {}
    if r.live is not None and w.rank == 0:
        drained = r.live.drain()  # a refresh still running: its metrics at the last step
        if drained:
            w.log(drained, r.steps, r.steps)
        refresh = r.live.summary()
    searcher: Any = r.search  # evaluate asks any object for search(questions, k) (it names the generator's client)
    results, predictions = evaluate(r.model.generator, r.builder, r.data.gen, searcher, r.cfg, w.device, w.rank,
                                    w.world)  # fmt: skip
    if r.live is not None:  # RAG read the live index (older snapshots' rows): not the index the run ships
        results, predictions = live_labelled(results), live_labelled(predictions)
    ran = r.steps - r.start_step  # steps of this attempt (after a restart: since the checkpoint)
    summary = {
        "step": r.steps,
        "train/seconds": loop_s,
        "train/samples_per_s": ran * r.global_batch / loop_s,
        "train/final_loss": r.history[-1]["loss"],
        **refresh,
        **{f"{mode}/{k}": v for mode, res in results.items() for k, v in res.items()},
    }

    def write(folder: Path) -> None:  # rank 0: both models and the run's curves into the final checkpoint
        save_weights(r.model.encoder.state_dict(), folder)
        save_generator(r.model.generator, r.builder.tok, folder / GENERATOR_FOLDER)
        Path(folder, HISTORY_FILE).write_text(json.dumps(r.history, indent=1))
        Path(folder, PREDICTIONS_FILE).write_text(json.dumps(predictions, indent=1))

    w.finish(summary, write)


def live_labelled(by_mode: dict[str, Any]) -> dict[str, Any]:
    """RAG's and the answer likelihood's entries as `live/rag`, `live/likelihood`: figures of the live index, which
    the run does not ship."""
    return {LIVE + m if m in ("rag", "likelihood") else m: v for m, v in by_mode.items()}


def checkpoint_encoder(cfg: Config, folder: str | Path) -> dict[str, torch.Tensor]:
    """The encoder weights of a joint training checkpoint (rank 0's file of both models), on the driver: a run
    resumed with a trained passage encoder starts its live index from them."""
    path = Path(folder) / "rank0.safetensors"
    encoder = build_encoder(cfg.retriever)
    try:
        state = {k.removeprefix("encoder."): v for k, v in load_file(str(path)).items() if k.startswith("encoder.")}
        load_state(encoder, state)  # strict: every key of the encoder, none of another architecture
    except Exception as e:  # a truncated file, another encoder
        raise CheckpointError(
            f"checkpoint {folder} is corrupt or incompatible ({type(e).__name__}: {e}); delete it to fall back to "
            "an earlier one, or start a new run (resume=false)"
        ) from None
    return {k: v.detach().clone() for k, v in encoder.state_dict().items()}


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
