"""Training checkpoints that continue a run exactly (retriever and generator stages), and fault injection.

Layout of one checkpoint folder (Ray Train merges every rank's files into it):
    meta.json                    step, world size, fit id (rank 0), and what the stage adds (the retriever: the
                                 live index's newest version number, `live_version`); a final checkpoint: "final"
    rank{r}.safetensors          rank r's model replica (encoder replicas differ under local SGD / gossip)
    rank{r}_state.pt             optimizer, scheduler, the stage's extra state (sync-strategy buffers; the generator's
                                 grad scaler and loss history), RNG states (torch.save of tensors and plain
                                 containers only: loaded with weights_only=True, never an arbitrary pickle)
The data position is the step: batches are a pure function of (seed, step) in both stages.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from ragtrain.runtime.console import get_logger

log = get_logger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: corrupt, incomplete, or written by a different run layout."""


def save_train_state(
    folder: str | Path,
    rank: int,
    world: int,
    step: int,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    sched: Any,
    extra: dict[str, Any],
    fit_id: str = "",
    info: dict[str, Any] | None = None,
) -> None:
    """Write this rank's part of the checkpoint at `step` (completed optimizer steps) into `folder`; `info` (plain
    values, rank 0's) goes into meta.json for the driver to read without loading the state."""
    folder = Path(folder)
    # save_model stores tied tensors once (a generator's shared embeddings); save_file would refuse them
    save_model(model, str(folder / f"rank{rank}.safetensors"))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(
        {"optim": optim.state_dict(), "sched": sched.state_dict(), "extra": extra, "rng": rng, "step": step},
        folder / f"rank{rank}_state.pt",
    )
    if rank == 0:
        meta = {**(info or {}), "step": step, "world": world, "fit_id": fit_id}
        (folder / "meta.json").write_text(json.dumps(meta))


def load_train_state(
    folder: str | Path, rank: int, world: int, model: nn.Module, optim: torch.optim.Optimizer, sched: Any
) -> tuple[int, dict[str, Any]]:
    """Restore this rank's part of a checkpoint; returns (step to continue from, the stage's extra state)."""
    folder = Path(folder)
    meta = read_meta(folder)
    if meta["world"] != world:
        raise CheckpointError(
            f"{folder} was written by {meta['world']} workers, this run has {world}: "
            "set resources.trainer.num_workers to match, or start a new run (resume=false)"
        )
    try:
        load_model(model, str(folder / f"rank{rank}.safetensors"), strict=True)
        # On the CPU whatever device wrote it: the optimizer moves its state to the parameters' device, the sync
        # strategy its own; a GPU index may differ after a restart, and a GPU checkpoint may resume on a CPU
        state = torch.load(folder / f"rank{rank}_state.pt", weights_only=True, map_location="cpu")
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
    except Exception as e:  # a truncated file, a foreign architecture, a pickle that is not plain data
        raise CheckpointError(
            f"checkpoint {folder} is corrupt or incompatible ({type(e).__name__}: {e}); "
            "delete it to fall back to an earlier one, or start a new run (resume=false)"
        ) from None
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return int(state["step"]), state["extra"]


def read_meta(folder: str | Path) -> dict[str, Any]:
    """The checkpoint's meta.json, checked."""
    path = Path(folder) / "meta.json"
    try:
        meta = json.loads(path.read_text())
        return {**meta, "step": int(meta["step"]), "world": int(meta["world"])}
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {folder} is not a complete ragtrain checkpoint") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}): the checkpoint is corrupt") from None


def is_complete(folder: Path, meta: dict[str, Any]) -> bool:
    """Every rank's files are there (a worker that died while uploading leaves a partial folder)."""
    if meta.get("final"):
        return (folder / meta.get("weights", "encoder.safetensors")).exists()
    return all(
        (folder / f"rank{r}.safetensors").exists() and (folder / f"rank{r}_state.pt").exists()
        for r in range(meta["world"])
    )


def latest_checkpoint(storage: str | Path, fit_id: str | None = None) -> Path | None:
    """The complete checkpoint with the highest step under a Ray Train run's storage folder (None if none);
    with `fit_id`, only checkpoints written by that fit."""
    found = []
    for meta_path in Path(storage).glob("checkpoint_*/meta.json"):
        meta = read_meta(meta_path.parent)
        if (fit_id is None or meta.get("fit_id") == fit_id) and is_complete(meta_path.parent, meta):
            found.append((meta["step"], str(meta_path.parent)))
    return Path(max(found)[1]) if found else None


def restart_checkpoint(storage: str | Path, fit_id: str, resume_from: str | None) -> Path | None:
    """Inside a Train worker: the checkpoint to continue from -- the latest complete one this fit wrote, else the
    one the fit was started from (resume=true). Ray Train's own registry can miss a checkpoint that was uploaded
    just before a worker died (its controller had not polled the report yet), so `storage` is scanned too."""
    import ray.train  # lazy: ray is heavy (~0.5 s); this module imports without it

    candidates = [Path(resume_from)] if resume_from else []
    given = ray.train.get_checkpoint()
    if given is not None:
        candidates.append(Path(given.path))
    mine = latest_checkpoint(storage, fit_id=fit_id)
    if mine is not None:
        candidates.append(mine)
    return max(candidates, key=lambda p: read_meta(p)["step"]) if candidates else None


def restore_in_worker(
    storage: str | Path,
    config: dict[str, Any],
    rank: int,
    world: int,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    sched: Any,
    sink: Any,
    stage: str,
) -> tuple[int, dict[str, Any], Any]:
    """Inside a Train worker: continue from `restart_checkpoint` if there is one (a worker-group restart under
    fault.max_failures, or resume=true). Returns (first step to run, the stage's extra state or {}, the metric
    sink), the sink set to skip (key, step) pairs the run already holds, since the steps after the checkpoint are
    replayed and must be logged once."""
    path = restart_checkpoint(storage, config["fit_id"], config.get("resume_from"))
    if path is None:
        return 0, {}, sink
    step, extra = load_train_state(path, rank, world, model, optim, sched)
    if sink is not None:
        sink = replace(sink, skip_logged=True)
    if rank == 0:
        log.info(f"[{stage}] resumed at step {step} from {path}")
    return step, extra, sink


def resume_point(storage: str | Path, resume: bool) -> tuple[Path | None, dict[str, Any]]:
    """On the driver, resume=true: the stage's latest complete checkpoint and its meta (None, {} otherwise)."""
    path = latest_checkpoint(storage) if resume else None
    return path, (read_meta(path) if path is not None else {})


def maybe_inject_fault(kill_at: int, kill_rank: int, output_dir: str, stage: str, rank: int, step: int) -> None:
    """fault.kill_worker_at_step: this worker process dies (os._exit, no cleanup, like a crash) once per stage."""
    if not kill_at or step != kill_at or rank != kill_rank:
        return
    marker = fault_marker(output_dir, stage, rank, step)
    if marker.exists():  # the restarted worker passes this step again: it must not die twice
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("killed")
    log.info(f"[fault] {stage} rank {rank} exits at step {step} (fault.kill_worker_at_step)")
    os._exit(1)


def fault_marker(output_dir: str | Path, stage: str, rank: int, step: int) -> Path:
    """The file that records an injected kill (tests check it: the worker really died)."""
    return Path(output_dir, "ray", f".fault_injected_{stage}_rank{rank}_step{step}")
