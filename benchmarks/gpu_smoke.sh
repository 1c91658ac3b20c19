#!/usr/bin/env bash
# GPU smoke test: tests/gpu (the code paths only a GPU runs), then the generator stage: BERT2BERT-from-MiniLM on the synthetic KB, DDP over NCCL with bf16
# autocast, up to 2 workers (one GPU each: NCCL cannot put two ranks on one device), a short run; prints the
# training tokens/s and samples/s and the EM of the three eval modes. The CPU test suite never needs this script.
#
#   bash benchmarks/gpu_smoke.sh                 # 200 steps
#   STEPS=50 bash benchmarks/gpu_smoke.sh        # shorter
#   CPU_DRY_RUN=1 bash benchmarks/gpu_smoke.sh   # check the script on a CPU machine (tiny T5, gloo, 6 steps)
#
# stages: [index, generator]: the untrained MiniLM index (CPU pool), then the generator stage on it. Not yet run
# on a GPU machine (none was available while writing it). Exits 0 with "SKIP" when no CUDA GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-200}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "${CPU_DRY_RUN:-0}" = 1 ]; then  # check this script itself on a CPU box: tiny T5, gloo, fp32, 6 steps
  WORKERS=1; STEPS=6
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
  WORKERS=$(( NGPU >= 2 ? 2 : 1 ))
  [ "$WORKERS" -lt 2 ] && echo "note: $NGPU GPU visible: running 1 NCCL worker (2 workers need 2 GPUs)"
fi
OUT=${OUT:-outputs/gpu_smoke/$(date +%Y%m%d_%H%M%S)}
# First the unit tests of the paths only a GPU runs (NCCL tensors, CUDA timing, GPU checkpoints; skipped on a CPU)
"$PY" -m pytest -q -p no:cacheprovider tests/gpu

"$PY" - "$WORKERS" "$STEPS" "$OUT" "${CPU_DRY_RUN:-0}" <<'EOF'
import sys, time
from pathlib import Path

from hydra import compose as hydra_compose, initialize_config_dir

from ragtrain.config import register_configs, to_typed
from ragtrain.pipeline import run


def compose(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(Path("conf").resolve()), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


workers, steps, out, dry = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
overrides = [
    "experiment=rag_quickstart", "resources=gpu_node", f"resources.trainer.num_workers={workers}",
    f"generator.train.num_workers={workers}", "generator.train.cpus_per_worker=4", "generator.train.precision=bf16",
    f"generator.train.max_steps={steps}", f"generator.train.oracle_steps={steps // 2}",
    "generator.train.warmup_steps=20", "generator.train.batch_size=64", "generator.train.log_every=25",
    "generator.retrieval.num_actors=2", "generator.retrieval.cpus_per_actor=1", "logger=none", f"output_dir={out}",
]
if dry:
    overrides += ["resources=laptop", "retriever=tiny", "data.num_entities=24", "generator=tiny_t5",
                  "generator.train.precision=fp32", "generator.train.cpus_per_worker=1", "generator.train.batch_size=4",
                  "generator.train.log_every=2", "generator.retrieval.num_actors=1", "generator.retrieval.cpus_per_actor=0"]
cfg = to_typed(compose(overrides + ["stages=[index,generator]"]))  # the untrained-MiniLM index, then the generator
start = time.perf_counter()
res = run(cfg)
t = res["gen_train"]
how = "CPU dry run, gloo" if dry else "NCCL, bf16"
print(f"\nGPU smoke ({how}): {workers} worker(s), {t['steps']:.0f} steps of global batch "
      f"{cfg.generator.train.batch_size * workers}: {t['tokens_per_s']:.0f} tokens/s, {t['samples_per_s']:.1f} "
      f"samples/s; EM closed-book {res['gen_closed_book']['em']:.3f} / RAG {res['gen_rag']['em']:.3f} / "
      f"oracle {res['gen_oracle']['em']:.3f}; {time.perf_counter() - start:.0f} s in all")
EOF
