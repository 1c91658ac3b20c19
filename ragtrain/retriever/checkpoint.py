"""Training checkpoints that continue a run exactly: per-rank weights, optimizer, LR schedule, sync state, RNG.

Layout of one checkpoint folder (Ray Train merges every rank's files into it):
    meta.json                    step, world size (rank 0)
    rank{r}.safetensors          rank r's encoder replica (replicas differ under local SGD / gossip)
    rank{r}_state.pt             optimizer, scheduler, sync-strategy state, RNG states (torch.save of tensors and
                                 plain containers only: loaded with weights_only=True, never an arbitrary pickle)
The data position is the step: batches are a pure function of (seed, step) (ragtrain/retriever/batching.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: corrupt, incomplete, or written by a different run layout."""


def save_train_state(folder: str | Path, rank: int, world: int, step: int, encoder: nn.Module,
                     optim: torch.optim.Optimizer, sched: Any, sync_state: dict[str, Any], fit_id: str = "") -> None:
    """Write this rank's part of the checkpoint at `step` (completed optimizer steps) into `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    save_file({k: v.detach().cpu().contiguous() for k, v in encoder.state_dict().items()},
              str(folder / f"rank{rank}.safetensors"))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"optim": optim.state_dict(), "sched": sched.state_dict(), "sync": sync_state, "rng": rng, "step": step},
               folder / f"rank{rank}_state.pt")
    if rank == 0:
        (folder / "meta.json").write_text(json.dumps({"step": step, "world": world, "fit_id": fit_id}))


def load_train_state(folder: str | Path, rank: int, world: int, encoder: nn.Module,
                     optim: torch.optim.Optimizer, sched: Any) -> tuple[int, dict[str, Any]]:
    """Restore this rank's part of a checkpoint; returns (step to continue from, the sync strategy's state)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    meta = read_meta(folder)
    if meta["world"] != world:
        raise CheckpointError(f"{folder} was written by {meta['world']} workers, this run has {world}: "
                              "set resources.trainer.num_workers to match, or start a new run (resume=false)")
    try:
        encoder.load_state_dict(load_file(str(folder / f"rank{rank}.safetensors")), strict=True)
        state = torch.load(folder / f"rank{rank}_state.pt", weights_only=True)
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
    except Exception as e:  # a truncated file, a foreign architecture, a pickle that is not plain data
        raise CheckpointError(f"checkpoint {folder} is corrupt or incompatible ({type(e).__name__}: {e}); "
                              "delete it to fall back to an earlier one, or start a new run (resume=false)") from None
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return int(state["step"]), state["sync"]


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
        return (folder / "encoder.safetensors").exists()
    return all((folder / f"rank{r}.safetensors").exists() and (folder / f"rank{r}_state.pt").exists()
               for r in range(meta["world"]))


def latest_checkpoint(storage: str | Path, fit_id: Optional[str] = None) -> Optional[Path]:
    """The complete checkpoint with the highest step under a Ray Train run's storage folder (None if none);
    with `fit_id`, only checkpoints written by that fit."""
    found = []
    for meta_path in Path(storage).glob("checkpoint_*/meta.json"):
        meta = read_meta(meta_path.parent)
        if (fit_id is None or meta.get("fit_id") == fit_id) and is_complete(meta_path.parent, meta):
            found.append((meta["step"], str(meta_path.parent)))
    return Path(max(found)[1]) if found else None
