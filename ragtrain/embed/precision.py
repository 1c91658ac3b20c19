"""Which floating-point precision a model runs in: `auto` is bf16 only where the device runs bf16 natively.

bf16 pays off only on hardware with bf16 units: a CUDA GPU that supports it, or a CPU where oneDNN reports native
bf16 (AVX512-BF16 / AMX). Elsewhere PyTorch emulates it, and on an AVX2 CPU MiniLM encodes at 0.17x of fp32 under
bf16 autocast and 0.21x with bf16 weights: `auto` then means fp32. The resolution happens where the model runs (a
trainer worker, an encode actor), since the driver may see another device than its workers; the driver resolves
the same way for the keys it needs before any encode (vector cache key, index metadata, MLflow params), on the
encode actors' device.
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum

import torch

from ragtrain.config import Config
from ragtrain.config.index import IndexConfig
from ragtrain.config.retriever import Precision
from ragtrain.runtime.console import get_logger

log = get_logger(__name__)

AUTO, BF16, FP32 = "auto", "bf16", "fp32"
# What an emulated bf16 costs on a CPU without bf16 units (AVX2 EPYC, MiniLM encode): said in the warning
EMULATED_BF16_SPEED = "0.17x the speed of fp32 under autocast, 0.21x with bf16 weights (MiniLM encode, AVX2 CPU)"

_said: set[str] = set()  # lines already logged by this process (once per key and outcome)

PrecisionLike = str | Enum


def _value(precision: PrecisionLike) -> str:
    return str(getattr(precision, "value", precision))


def cpu_capability() -> str:
    """The vector ISA PyTorch dispatches to on this CPU (DEFAULT, AVX2, AVX512, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # older torch: no such query
        return "unknown ISA"


def cpu_bf16_native() -> bool:
    """Whether oneDNN runs bf16 natively on this CPU (AVX512-BF16 or AMX), per torch."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN, or without this query
        return False


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """(does `device` run bf16 natively, a short description of why) for a CPU or CUDA device."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA requested but not available"
        name = torch.cuda.get_device_name(device)
        ok = bool(torch.cuda.is_bf16_supported())
        return ok, f"GPU {name}: {'native bf16' if ok else 'no bf16 support'}"
    if device.type == "cpu":
        ok = cpu_bf16_native()
        return ok, f"CPU: {cpu_capability()}, {'native bf16 (oneDNN)' if ok else 'no native bf16'}"
    return False, f"{device.type}: bf16 support unknown"


def resolve_with_reason(precision: PrecisionLike, device: torch.device | str) -> tuple[str, str]:
    """(the precision to run in, why) for a configured precision on `device`; only `auto` changes."""
    value = _value(precision)
    if value != AUTO:
        return value, "set explicitly"
    native, why = native_bf16(device)
    return (BF16 if native else FP32), why


def _once(line: str, warning: bool = False) -> None:
    if line not in _said:
        _said.add(line)
        (log.warning if warning else log.info)(line)


def resolve(precision: PrecisionLike, device: torch.device | str, key: str = "precision", announce: bool = True) -> str:
    """The precision to run `precision` in on `device`: fp32 / bf16 (fp16 passes through). `auto` -> bf16 where the
    device runs it natively, else fp32; with `announce`, the choice and why are logged once per process, and an
    explicit bf16 on a CPU without native bf16 logs one warning with the expected slow-down (the per-batch calls
    inside the models pass announce=False: the driver or a trainer's rank 0 speaks for them)."""
    device = torch.device(device)
    value = _value(precision)
    chosen, why = resolve_with_reason(value, device)
    if value == AUTO and announce:
        _once(f"[precision] {key} auto -> {chosen} ({why})")
    if announce and value == BF16 and device.type == "cpu" and not cpu_bf16_native():
        _once(
            f"[precision] {key}=bf16 on a CPU without native bf16 ({cpu_capability()}): expect about "
            f"{EMULATED_BF16_SPEED}; {key}=auto picks fp32 here",
            warning=True,
        )
    return chosen


def _probe(precision: str) -> tuple[str, str]:
    """Run in a Ray task on the workers' resources: how `precision` resolves there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_with_reason(precision, device)


def expected(precision: PrecisionLike, gpus: float, key: str, announce: bool = True) -> str:
    """How `precision` resolves for workers that take `gpus` GPUs each (0: CPU workers, resolved on this CPU),
    logged once: what the driver records (cache keys, index metadata, MLflow params) before the workers run. A GPU
    the driver does not see is asked about in a Ray task on a sliver of one."""
    value = _value(precision)
    if value != AUTO or gpus <= 0 or torch.cuda.is_available():
        return resolve(value, "cuda" if gpus > 0 else "cpu", key, announce)
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    # a sliver of a GPU: the question needs a GPU's kind, not its capacity (runs holding fractions leave slivers)
    chosen, why = ray.get(ray.remote(num_gpus=min(gpus, 0.01), num_cpus=0)(_probe).remote(value))
    if announce:
        _once(f"[precision] {key} auto -> {chosen} ({why})")
    return chosen


def resolved_index(cfg: Config) -> IndexConfig:
    """`cfg.index` with `precision` resolved for the corpus encode actors (resources.pool.gpus_per_actor)."""
    chosen = expected(cfg.index.precision, cfg.resources.pool.gpus_per_actor, "index.precision")
    return cfg.index if _value(cfg.index.precision) == chosen else replace(cfg.index, precision=Precision(chosen))


def resolved_params(cfg: Config) -> dict[str, str]:
    """The precision each stage of `cfg` runs in, auto resolved (MLflow params next to the configured `auto`):
    precision/index, and precision/retriever_train, precision/generator_train for the stages that train. The
    trainers' own line comes from their rank 0, so these are not announced again."""
    gpus = 1.0 if cfg.resources.trainer.use_gpu else 0.0
    out = {"precision/index": _value(resolved_index(cfg).precision)}
    if "retriever" in cfg.stages:
        out["precision/retriever_train"] = expected(
            cfg.retriever.train.precision, gpus, "retriever.train.precision", announce=False
        )
    if "generator" in cfg.stages:
        out["precision/generator_train"] = expected(
            cfg.generator.train.precision, gpus, "generator.train.precision", announce=False
        )
    return out
