"""Plain torchrun + DDP baseline for the retriever training step (no Ray), used by train_throughput.py.

Launch (train_throughput.py does this for you)::

    OMP_NUM_THREADS=1 torchrun --nnodes 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 \
        benchmarks/torchrun_baseline.py --data synthetic --batch-size 16 --warmup 3 --steps 10 --out /tmp/b.json

The model math is ragtrain's (imported, not copied): ``build_encoder`` (MiniLM, mean pooling, L2 norm),
``QPEncoder`` (queries and passages in one forward), ``tokenize``, ``contrastive_loss`` (all-gather with grad,
gold masking) and the same batches (``local_batch``: the same global batch at every step, each rank its slice).
What this script owns, i.e. what is being compared against Ray Train: process launch, process group (gloo),
the DDP wrapper, the AdamW + linear warm-up/decay schedule, grad clipping and the loop itself.
Each rank uses ``torch.set_num_threads(--threads)`` (1 by default, like a 1-CPU Ray Train worker).

Timing: rank 0 takes a ``time.perf_counter`` stamp after every step (after ``loss.item()``, as ragtrain's loop
does); throughput = steps x global batch / (t[warmup + steps] - t[warmup]); rank 0's CPU seconds per timed step
(``time.process_time``) too. Per-step losses are all-reduced once
after training (outside the timed region) so window losses can be compared with ragtrain's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
# $RAGTRAIN_DATA (relative: to the checkout, as the configs read it), else ../shared/data
DEFAULT_SCIFACT = (HERE.parent / os.environ.get("RAGTRAIN_DATA", "../shared/data")).resolve() / "scifact"


def scifact_available(root: str | Path) -> bool:
    return (Path(root) / "queries.jsonl").exists() and (Path(root) / "qrels" / "train.tsv").exists()


def load_train_data(data: str, scifact_root: str | Path = DEFAULT_SCIFACT, num_entities: int = 200):
    """The retriever TrainData exactly as ragtrain.pipeline.stages builds it (no hard negatives)."""
    from ragtrain.retriever.batching import TrainData, build_examples

    if data == "scifact":
        from ragtrain.data import load_beir

        d = load_beir(scifact_root, split="dev", dev_size=100, seed=0)
    else:
        from ragtrain.data import make_synthetic

        d = make_synthetic(num_entities=num_entities, seed=0, split="dev")
    passages = [p.full_text() for p in d.corpus.values()]
    pos = {doc_id: i for i, doc_id in enumerate(d.corpus)}
    return TrainData(passages, build_examples(d.queries, d.train_qrels, pos, None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", choices=["synthetic", "scifact"], default="synthetic")
    ap.add_argument("--scifact-root", default=str(DEFAULT_SCIFACT))
    ap.add_argument("--num-entities", type=int, default=200)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--batch-size", type=int, default=16, help="queries per worker per step")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="measured steps after warm-up")
    ap.add_argument("--query-max-length", type=int, default=64)
    ap.add_argument("--passage-max-length", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup-ratio", type=float, default=0.1, help="LR schedule warm-up (as ragtrain)")
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="rank 0 writes its timings here (JSON)")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.embed.model import build_encoder, load_tokenizer, tokenize
    from ragtrain.retriever.batching import local_batch
    from ragtrain.retriever.loss import contrastive_loss
    from ragtrain.retriever.train import QPEncoder

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    rcfg = RetrieverConfig(
        model=args.model,
        query_max_length=args.query_max_length,
        passage_max_length=args.passage_max_length,
        temperature=args.temperature,
    )
    data = load_train_data(args.data, args.scifact_root, args.num_entities)
    encoder = build_encoder(rcfg)
    encoder.train()
    tokenizer = load_tokenizer(rcfg)
    model = DistributedDataParallel(QPEncoder(encoder)) if world > 1 else QPEncoder(encoder)

    steps = args.warmup + args.steps
    global_batch = args.batch_size * world
    optim = torch.optim.AdamW(encoder.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched_warm = int(args.warmup_ratio * steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim,
        lambda s: (
            (s + 1) / max(1, sched_warm) if s < sched_warm else max(0.0, (steps - s) / max(1, steps - sched_warm))
        ),
    )

    dist.barrier()
    stamps, cpu = [time.perf_counter()], [time.process_time()]
    losses = []
    for step in range(steps):
        queries, pids, golds = local_batch(data, global_batch, step, args.seed, rank, world, 0)
        q = tokenize(tokenizer, queries, args.query_max_length)
        p = tokenize(tokenizer, [data.passages[i] for i in pids], args.passage_max_length)
        gmax = max(len(g) for g in golds)
        q_gold = torch.tensor([g + [-1] * (gmax - len(g)) for g in golds])
        q_emb, p_emb = model(q, p)
        loss = contrastive_loss(q_emb, p_emb, args.temperature, q_gold, torch.tensor(pids))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(encoder.parameters(), args.grad_clip)
        optim.step()
        sched.step()
        losses.append(loss.item())
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())

    # Mean loss over ranks per step (outside the timed region).
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)
    mean_losses = (lt / world).tolist()
    if rank == 0:
        measured_s = stamps[steps] - stamps[args.warmup]
        result = {
            "world_size": world,
            "batch_size": args.batch_size,
            "global_batch": global_batch,
            "warmup_steps": args.warmup,
            "measured_steps": args.steps,
            "measured_seconds": measured_s,
            "samples_per_s": args.steps * global_batch / measured_s,
            "step_seconds": [b - a for a, b in zip(stamps, stamps[1:])],
            "rank0_cpu_s_per_step": (cpu[steps] - cpu[args.warmup]) / args.steps,
            "losses": mean_losses,
            "threads": torch.get_num_threads(),
        }
        print(
            f"[torchrun] {args.steps} steps x {global_batch} samples in {measured_s:.2f}s: "
            f"{result['samples_per_s']:.2f} samples/s"
        )
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
